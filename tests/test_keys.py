from __future__ import annotations

import re
from pathlib import Path

import pytest
from redis.crc import key_slot

from affinity import Keys
from affinity.scripts import NAMES, lua_string, source

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("namespace", ["affinity", "prod-eu", "x"])
def test_every_key_shares_one_slot(namespace: str) -> None:
    k = Keys(namespace)
    keys = [
        k.rr,
        k.token,
        k.nodes,
        k.ring,
        k.full,
        k.route,
        k.devices,
        k.events,
        k.episode("ep-42"),
        k.episode("ü" * 100),
        k.node("gpu-a"),
        k.device("gpu-a/1"),
        k.load("gpu-b/7"),
    ]
    assert all(key.startswith("{" + namespace + "}:") for key in keys)
    assert len({key_slot(key.encode()) for key in keys}) == 1


def test_readable_key_names() -> None:
    k = Keys()
    assert k.episode("ep-42") == "{affinity}:episode:ep-42"
    assert k.device("gpu-a/1") == "{affinity}:device:gpu-a/1"
    assert k.load("gpu-a/1") == "{affinity}:load:gpu-a/1"
    assert k.node("gpu-a") == "{affinity}:node:gpu-a"
    assert k.rr == "{affinity}:rr" and k.token == "{affinity}:token"


@pytest.mark.parametrize("bad", ["", "a{b", "a}b", "a:b", "a b", "x" * 65])
def test_bad_namespace(bad: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        Keys(bad)


def test_no_key_literals_outside_keys_module() -> None:
    pattern = re.compile(
        r"""["'][^"']*\}:(episode|node|device|load|rr|token|nodes|events|ring|full|route)"""
    )
    offenders = [
        str(p.relative_to(ROOT))
        for folder in ("affinity", "node")
        for p in (ROOT / folder).rglob("*.py")
        if p.name != "keys.py" and pattern.search(p.read_text())
    ]
    assert offenders == []


@pytest.mark.parametrize("name", NAMES)
def test_scripts_have_headers_and_use_no_scan(name: str) -> None:
    text = source(name)
    assert text.startswith("-- " + name + ":")
    assert "KEYS[1]" in text[:600]
    assert "\n--@lib\n" in text
    assert "'KEYS'" not in text and "'SCAN'" not in text


def test_lib_depends_on_no_call_arguments() -> None:
    text = source("lib")
    assert text.startswith("-- lib:")
    assert "KEYS[" not in text and "ARGV[" not in text
    assert "'KEYS'" not in text and "'SCAN'" not in text


@pytest.mark.parametrize("value", ["{affinity}:", "o'k\\x]]", "é\n\0", "%d(.*)$"])
def test_header_strings_are_escaped_lua_literals(value: str) -> None:
    literal = lua_string(value)
    assert literal.startswith("'") and literal.endswith("'")
    body = literal[1:-1]
    assert "'" not in body.replace("\\039", "") and "\n" not in body
    # decoding the \ddd escapes gives the bytes back
    decoded = re.sub(rb"\\(\d{3})", lambda m: bytes([int(m.group(1))]), body.encode())
    assert decoded == value.encode()
