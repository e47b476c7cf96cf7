"""Run by tests/test_recorder_lerobot.py in the lerobot environment (tests/lerobot_env.sh):
loads a dataset the fleet wrote with LeRobot's own, unmodified ``LeRobotDataset`` and checks
it against what the robots sent and received (``truth.json``). Prints ``ok`` or raises."""

from __future__ import annotations

import json
import sys

import numpy as np
from lerobot.datasets.lerobot_dataset import LeRobotDataset


def main(root: str, truth_path: str) -> None:
    with open(truth_path) as fh:
        truth = json.load(fh)
    ds = LeRobotDataset("affinity/recorded", root=root)
    sent, got, resets = truth["sent"], truth["got"], truth["resets"]
    assert ds.num_episodes == len(sent), (ds.num_episodes, len(sent))
    assert len(ds) == sum(len(v) for v in sent.values()), len(ds)
    episodes = ds.meta.episodes
    for ep_index in range(ds.num_episodes):
        meta = episodes[ep_index]
        episode = meta["affinity/episode_id"]
        start, end = meta["dataset_from_index"], meta["dataset_to_index"]
        assert end - start == len(sent[episode]) == meta["length"], episode
        for n, i in enumerate(range(start, end)):
            item = ds[i]
            assert int(item["episode_index"]) == ep_index and int(item["frame_index"]) == n
            for name, want in sent[episode][n].items():
                value = item[name].numpy()
                if truth["images"].get(name):  # float CHW in [0, 1], as LeRobot gives images
                    value = np.rint(value.transpose(1, 2, 0) * 255).astype(np.uint8)
                    want = np.asarray(want, np.uint8)
                np.testing.assert_array_equal(value, np.asarray(want, value.dtype), episode)
            want_action = np.asarray(got[episode][n], np.float32)
            np.testing.assert_array_equal(item["action"].numpy(), want_action, episode)
            assert bool(item["state_reset"]) == resets[episode][n], (episode, n)
        if episode == truth.get("moved"):
            assert list(meta["affinity/nodes"]) == ["a", "b"], meta["affinity/nodes"]
    print("ok", len(ds), ds.num_episodes)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
