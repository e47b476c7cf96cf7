// affinity fleet page: plain JavaScript, no build step, talks only to the node serving it.
//
// Reads GET nodes + devices every POLL_MS (and soon after each event), follows
// GET events/stream (server-sent events, read with fetch() and a streaming reader, so
// that it can send the API key; it resumes after the newest event shown), looks episodes
// up with GET episodes/{id}. A node with --api-key answers those 401: the page then asks
// for the key and sends it as "Authorization: Api-Key <key>" (kept in this page's memory
// only, never stored, never in a URL). With an admin token typed in (likewise) it shows
// drain/undrain buttons that call POST devices/{id}/drain?move=true|undrain with
// "Authorization: Bearer <token>" (a drain moves the device's episodes with their state).
(() => {
  "use strict";

  const POLL_MS = 2000;
  const EVENT_REFRESH_GAP_MS = 500; // an event refreshes the grid at most this often
  const MAX_EVENTS = 300;
  const BACKLOG = 100;
  const RECONNECT_MS = 5000; // after a refusal or a failed connection
  const RETRY_MS = 2000; // after a stream that ended

  const $ = (id) => document.getElementById(id);
  let adminToken = null;
  let apiKey = null;
  let state = { self: "", nodes: [], devices: [], at: 0 };
  const rows = new Map(); // node id -> {row, card, devices}
  const cells = new Map(); // device id -> cell parts

  // ---- small helpers ------------------------------------------------------------------

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function seconds(ms) {
    const s = Math.abs(ms) / 1000;
    if (s < 60) return s.toFixed(1) + "s";
    if (s < 3600) return Math.floor(s / 60) + "m" + String(Math.floor(s % 60)).padStart(2, "0") + "s";
    return Math.floor(s / 3600) + "h" + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
  }

  function brief(v) { // a long list (a node's devices) as its first item and a count
    const items = v.split(",");
    if (v.length > 40 && items.length > 2) return items[0] + ",… (" + items.length + ")";
    return v.length > 120 ? v.slice(0, 119) + "…" : v;
  }

  function devicePath(id) {
    return String(id).split("/").map(encodeURIComponent).join("/");
  }

  function streamKey(id) {
    const [ms, seq] = String(id).split("-");
    return [Number(ms) || 0, Number(seq) || 0];
  }

  function newer(a, b) { // stream id a after b
    const x = streamKey(a), y = streamKey(b);
    return x[0] > y[0] || (x[0] === y[0] && x[1] > y[1]);
  }

  function shortProvider(p) {
    if (!p) return "—";
    return String(p).replace("ExecutionProvider", "").replace("Tensorrt", "TensorRT");
  }

  function hardware(d) {
    const name = String(d.name || "").replace(/^NVIDIA\s+/, "");
    const parts = [name || d.kind || "?"];
    if (d.arch && d.arch !== parts[0]) parts.push(d.arch);
    return parts.join(" · ");
  }

  function keyHeaders() { // what a read of episodes or the fleet sends
    if (apiKey) return { Authorization: "Api-Key " + apiKey };
    return adminToken ? { Authorization: "Bearer " + adminToken } : {};
  }

  function askForKey() { // the node wants its API key
    $("api-key").hidden = false;
    $("api-key-set").hidden = false;
    banner("key", "this node wants its API key (--api-key): type it in above");
  }

  async function getJSON(path) {
    const r = await fetch(path, { cache: "no-store",
                                  headers: { Accept: "application/json", ...keyHeaders() } });
    if (r.status === 401) askForKey();
    let body = null;
    try { body = await r.json(); } catch (e) { body = null; }
    return { status: r.status, body };
  }

  function message(res) {
    const err = res.body && res.body.error;
    return err ? err.message || err.code : "HTTP " + res.status;
  }

  const banners = new Map(); // source -> text
  function banner(source, text) {
    if (text) banners.set(source, text); else banners.delete(source);
    const b = $("banner");
    b.textContent = Array.from(banners.values()).join(" · ");
    b.hidden = banners.size === 0;
  }

  // ---- the grid -----------------------------------------------------------------------

  let timer = null, due = 0, inflight = false, again = false, lastStart = 0;

  function schedule(ms) {
    const at = Date.now() + ms;
    if (timer !== null && due <= at) return;
    clearTimeout(timer);
    due = at;
    timer = setTimeout(() => { timer = null; refresh(); }, ms);
  }

  async function refresh() {
    if (inflight) { again = true; return; }
    inflight = true;
    lastStart = Date.now();
    try {
      const [n, d] = await Promise.all([getJSON("nodes"), getJSON("devices")]);
      if (n.status !== 200 || d.status !== 200) {
        banner("fetch", "fleet not readable: " + message(n.status !== 200 ? n : d));
      } else {
        banner("fetch", null);
        state = { self: n.body.node, instance: n.body.instance, nodes: n.body.nodes || [],
                  devices: d.body.devices || [], at: Date.now() };
        render();
        refreshShadows();
      }
    } catch (e) {
      banner("fetch", "cannot reach this node (" + e.message + ")");
    } finally {
      inflight = false;
      if (again) { again = false; schedule(0); } else { schedule(POLL_MS); }
    }
  }

  // the shadows (affinity shadow) with the fleet's figures: GET shadows, beside the grid
  async function refreshShadows() {
    let res;
    try { res = await getJSON("shadows"); } catch (e) { return; }
    const rows = (res.status === 200 && res.body && res.body.shadows) || [];
    $("shadows").hidden = rows.length === 0;
    const body = $("shadow-rows");
    body.replaceChildren();
    for (const r of rows) {
      const tr = document.createElement("tr");
      for (const v of [r.candidate, r.live, r.state + " " + r.fraction, r.compared,
                       r.skipped, r.restarts, Number(r.max_abs).toPrecision(3)]) {
        const td = document.createElement("td");
        td.textContent = String(v);
        tr.append(td);
      }
      body.append(tr);
    }
  }

  function byNode() {
    const groups = new Map();
    for (const n of state.nodes) groups.set(n.node, { node: n, devices: [] });
    for (const d of state.devices) {
      if (!groups.has(d.node)) groups.set(d.node, { node: { node: d.node, missing: true }, devices: [] });
      groups.get(d.node).devices.push(d);
    }
    for (const g of groups.values()) g.devices.sort((a, b) => (a.index || 0) - (b.index || 0));
    return Array.from(groups.keys()).sort().map((k) => groups.get(k));
  }

  function render() {
    const grid = $("grid");
    const groups = byNode();
    const seenNodes = new Set(), seenDevices = new Set();
    let before = null;
    for (let i = groups.length - 1; i >= 0; i--) {
      const g = groups[i];
      seenNodes.add(g.node.node);
      let r = rows.get(g.node.node);
      if (!r) {
        r = makeRow(g.node.node);
        rows.set(g.node.node, r);
      }
      if (r.row.nextSibling !== before || r.row.parentNode !== grid) grid.insertBefore(r.row, before);
      before = r.row;
      updateCard(r, g);
      let cellBefore = null;
      for (let j = g.devices.length - 1; j >= 0; j--) {
        const d = g.devices[j];
        seenDevices.add(d.device);
        let c = cells.get(d.device);
        if (!c) { c = makeCell(d.device); cells.set(d.device, c); }
        if (c.cell.parentNode !== r.devices || c.cell.nextSibling !== cellBefore) {
          r.devices.insertBefore(c.cell, cellBefore);
        }
        cellBefore = c.cell;
        updateCell(c, d, g.node);
      }
    }
    for (const [id, r] of rows) if (!seenNodes.has(id)) { r.row.remove(); rows.delete(id); }
    for (const [id, c] of cells) if (!seenDevices.has(id)) { c.cell.remove(); cells.delete(id); }
    summarize(groups);
  }

  function makeRow(id) {
    const row = el("div", "node-row");
    row.dataset.node = id;
    const card = el("div", "node-card");
    const devices = el("div", "devices");
    row.append(card, devices);
    const parts = { name: el("span", "name"), self: el("span", "tag", "this node"),
                    lease: el("div"), url: el("div", "muted"), meta: el("div", "muted"),
                    models: el("div", "models"), procs: el("div", "procs") };
    const first = el("div");
    first.append(parts.name, parts.self);
    card.append(first, parts.lease, parts.url, parts.models, parts.procs, parts.meta);
    return { row, card, devices, parts };
  }

  function updateCard(r, g) {
    const n = g.node, p = r.parts;
    const alive = !!n.alive && !n.missing;
    r.card.classList.toggle("dead", !alive);
    r.row.dataset.alive = alive ? "yes" : "no";
    p.name.textContent = n.node;
    p.self.hidden = n.node !== state.self;
    if (n.missing) p.lease.textContent = "not registered";
    else if (alive) p.lease.textContent = "alive · lease " + seconds(n.lease_ms);
    else if (n.state === "left") p.lease.textContent = "left (stopped) " + seconds(n.lease_ms) + " ago";
    else p.lease.textContent = "lease lapsed " + seconds(n.lease_ms) + " ago";
    p.url.textContent = n.url || "";
    p.url.title = n.url || "";
    // a dead node's load sets are what it last held, not what it serves: not shown
    const load = alive ? g.devices.reduce((s, d) => s + (d.load || 0), 0) : "–";
    const cap = g.devices.reduce((s, d) => s + (d.capacity || 0), 0);
    const instance = n.instance || (n.node === state.self ? state.instance : "");
    const meta = [];
    if (n.version) meta.push("v" + n.version);
    if (instance) meta.push("inst " + String(instance).slice(0, 6));
    meta.push(load + "/" + cap);
    p.meta.textContent = meta.join(" · ");
    // the models every device of the node serves, as "name@version" (issue 24)
    p.models.textContent = (n.models || []).join(", ");
    // its processes as its last registration or renewal published them (issue 43)
    const procs = processes(n);
    p.procs.textContent = n.missing ? "" : procs.text; // no record: nothing known
    p.procs.title = procs.rows.join("\n");
    p.procs.classList.toggle("restarted", procs.restarts > 0 || procs.down > 0);
    r.row.dataset.fronts = String(n.fronts || 1);
    r.row.dataset.pids = (n.processes || []).map((q) => q.role + ":" + q.pid).join(",");
    r.card.title = [
      "live episodes / capacity: " + load + "/" + cap,
      "node: " + n.node, "url: " + (n.url || "?"), "version: " + (n.version || "?"),
      "instance: " + (instance || "?"),
      "started: " + (n.started_at_ms ? new Date(n.started_at_ms).toISOString() : "?"),
      "devices: " + g.devices.length,
      "models: " + ((n.models || []).join(", ") || "none registered"),
      "processes: " + procs.text, ...procs.rows,
    ].join("\n");
  }

  function lagText(q) { // a process's loop-lag p99 since the node's previous renewal
    if (!("lag_p99_ms" in q)) return "no sample";
    return q.lag_p99_ms === null ? ">2500ms" : "≤" + q.lag_p99_ms + "ms";
  }

  // A node's processes in a line (1 process, or the core and its fronts and device workers,
  // with what is wrong: processes not running, restarts, the worst loop lag) and a line per
  // process for its title, its helpers (the fronts' fork server) last. A node of an older
  // version publishes none: it is one process. A device worker (role "dev<index>") and a
  // helper have no event loop, so no lag.
  function processes(n) {
    const list = n.processes || [], fronts = n.fronts || 1, workers = n.workers || 0;
    const isWorker = (q) => q.role.startsWith("dev");
    const plural = (k) => (k !== 1 ? "s" : "");
    const frontsUp = list.filter((q) => q.role !== "core" && !isWorker(q)).length;
    const workersUp = list.filter(isWorker).length;
    const frontsDown = fronts > 1 && list.length ? Math.max(0, fronts - frontsUp) : 0;
    const workersDown = list.length ? Math.max(0, workers - workersUp) : 0;
    const down = frontsDown + workersDown;
    const helpers = n.helpers || []; // processes that serve no door (the fronts' fork server)
    const restarts = list.concat(helpers).reduce((s, q) => s + (q.restarts || 0), 0);
    let shape = fronts > 1 || workers ? "core" : "1 process";
    if (fronts > 1) shape += "+" + fronts + " fronts";
    if (workers) shape += "+" + workers + " device worker" + plural(workers);
    const parts = [shape];
    if (fronts > 1 && workers) { // both kinds: say which is down
      if (frontsDown) parts.push(frontsDown + " front" + plural(frontsDown) + " down");
      if (workersDown) parts.push(workersDown + " worker" + plural(workersDown) + " down");
    } else if (down) parts.push(down + " down");
    if (restarts) parts.push(restarts + " restart" + plural(restarts));
    const lags = list.filter((q) => "lag_p99_ms" in q);
    let text = parts.join(", ");
    if (lags.length) {
      const worst = lags.reduce((w, q) => (q.lag_p99_ms === null || (w.lag_p99_ms !== null &&
        q.lag_p99_ms > w.lag_p99_ms) ? q : w));
      text += " · lag " + lagText(worst);
    }
    const rows = list.map((q) => {
      const since = ": pid " + q.pid + " since " + new Date(q.since_ms).toISOString();
      if (q.role === "core") return "core" + since + ", loop lag p99 " + lagText(q);
      const restarted = ", " + (q.restarts || 0) + " restart(s)";
      if (isWorker(q)) return "device " + q.role.slice(3) + " worker" + since + restarted;
      return "front " + q.role + since + restarted + ", loop lag p99 " + lagText(q);
    }).concat(helpers.map((q) => (q.role === "forksrv" ? "fork server" : q.role) + ": pid " +
      q.pid + " since " + new Date(q.since_ms).toISOString() + ", " + (q.restarts || 0) +
      " restart(s)"));
    return { text, rows, restarts, down };
  }

  function makeCell(id) {
    const cell = el("div", "device");
    cell.dataset.device = id;
    const top = el("div", "top"), idx = el("span", "idx"), st = el("span", "st");
    top.append(idx, st);
    const hw = el("div", "hw");
    const bar = el("div", "bar"), track = el("span", "track"), fill = el("span", "fill");
    const num = el("span", "num");
    track.append(fill);
    bar.append(track, num);
    const foot = el("div", "foot"), prov = el("span", "prov"), crash = el("span", "crash");
    const button = el("button", "admin-only");
    button.type = "button";
    button.addEventListener("click", () => act(cell.dataset.device, button.dataset.action));
    foot.append(prov, crash, button);
    cell.append(top, hw, bar, foot);
    return { cell, idx, st, hw, fill, num, prov, crash, button };
  }

  function updateCell(c, d, node) {
    const alive = !!d.alive && !node.missing;
    const st = String(d.state || "unknown");
    c.cell.className = "device state-" + st + (alive ? "" : " dead");
    c.cell.dataset.state = st;
    c.cell.dataset.alive = alive ? "yes" : "no";
    c.idx.textContent = "#" + d.index;
    c.st.textContent = alive ? st : node.state === "left" ? "node left" : "node dead";
    c.hw.textContent = hardware(d);
    const load = alive ? Number(d.load) || 0 : 0, cap = Number(d.capacity) || 0;
    c.fill.style.width = (cap > 0 ? Math.min(100, (100 * load) / cap) : 0) + "%";
    c.fill.classList.toggle("full", alive && cap > 0 && load >= cap);
    c.num.textContent = (alive ? load : "–") + "/" + cap;
    c.prov.textContent = shortProvider(d.provider);
    const local = d.local;
    if (local) {
      const fails = Number(local.consecutive_failures) || 0;
      c.crash.textContent = "⚑" + fails + (local.crash_down ? " down" : "");
      c.crash.classList.toggle("failing", fails > 0 || !!local.crash_down);
      c.crash.title = "crash tracker on this node: " + fails + " consecutive failure(s)" +
        (local.crash_down ? ", marked down" : "") + "; " + (local.live_episodes || 0) +
        " episode state(s) held here";
    } else {
      c.crash.textContent = "";
      c.crash.title = "";
      c.crash.classList.remove("failing");
    }
    const action = st === "draining" ? "undrain" : "drain";
    c.button.dataset.action = action;
    c.button.textContent = action;
    c.button.title = action === "drain"
      ? "take no new episodes; move this device's episodes to other devices, with their state"
      : "take new episodes again";
    const lines = [
      d.device + " on " + d.node + (alive ? "" : " (node lease lapsed)"),
      "state: " + st + (d.reason ? " — " + d.reason : ""),
      (alive ? "live episodes: " + load : "live episodes: unknown (node dead)") +
        " / capacity " + cap + ", weight " + (d.weight ?? "?"),
      "kind: " + (d.kind || "?") + ", " + (d.name || "?") + (d.arch ? ", " + d.arch : "") +
        (d.memory_mb ? ", " + d.memory_mb + " MiB" : ""),
      "uuid: " + (d.uuid || "?"),
      "provider: " + (d.provider || "?"),
      "models: " + ((d.models || []).join(", ") || "none registered"),
    ];
    if (local) lines.push(c.crash.title);
    c.cell.title = lines.join("\n");
  }

  function summarize(groups) {
    const alive = groups.filter((g) => g.node.alive && !g.node.missing).length;
    // a dead node's devices count as on a dead node, whatever state they were left in
    const counts = { active: 0, draining: 0, down: 0, dead: 0 };
    let load = 0, cap = 0;
    for (const d of state.devices) {
      const st = d.alive ? d.state : "dead";
      counts[st] = (counts[st] || 0) + 1;
      if (d.alive) { load += d.load || 0; cap += d.capacity || 0; }
    }
    $("summary").textContent =
      alive + "/" + groups.length + " nodes alive · " + state.devices.length + " devices: " +
      counts.active + " active, " + counts.draining + " draining, " + counts.down + " down" +
      (counts.dead ? ", " + counts.dead + " on dead nodes" : "") + " · " +
      load + "/" + cap + " live episodes";
    $("served-by").textContent = state.self ? "served by " + state.self : "";
  }

  // ---- admin --------------------------------------------------------------------------

  function setAdmin(token) {
    adminToken = token || null;
    document.body.classList.toggle("is-admin", adminToken !== null);
    $("admin-token").hidden = adminToken !== null;
    $("admin-unlock").hidden = adminToken !== null;
    $("admin-lock").hidden = adminToken === null;
  }

  async function act(device, action) {
    if (!adminToken || !device) return;
    let res;
    try {
      const reason = $("drain-reason").value.trim() || "drained from /ui";
      // a drain moves the device's episodes to other devices with their state (its node
      // does, at its next lease renewal); one nothing can take stays, as it is
      const url = "devices/" + devicePath(device) + "/" + action +
        (action === "drain" ? "?move=true&reason=" + encodeURIComponent(reason) : "");
      const r = await fetch(url, { method: "POST",
                                   headers: { Authorization: "Bearer " + adminToken } });
      let body = null;
      try { body = await r.json(); } catch (e) { body = null; }
      res = { status: r.status, body };
    } catch (e) {
      banner("admin", action + " " + device + " failed: " + e.message);
      return;
    }
    if (res.status === 401 || res.status === 403) {
      setAdmin(null);
      banner("admin", "admin token refused (" + message(res) + "); buttons hidden");
    } else if (res.status !== 200) {
      banner("admin", action + " " + device + ": " + message(res));
    } else {
      banner("admin", null);
    }
    schedule(0);
  }

  // ---- events -------------------------------------------------------------------------

  let newest = "0-0", shown = 0;

  function addEventRow(ev) {
    const list = $("event-list");
    const li = el("li");
    li.dataset.id = ev.id;
    li.dataset.type = ev.type || "";
    const kind = eventKind(ev);
    li.dataset.kind = kind;
    const ms = streamKey(ev.id)[0];
    const t = new Date(ms);
    const time = el("span", "t", t.toLocaleTimeString([], { hour12: false }) + "." +
      String(t.getMilliseconds()).padStart(3, "0"));
    time.title = t.toISOString() + " (" + ev.id + ")";
    const ty = el("span", "ty ty-" + kind, kind);
    const f = el("span", "f");
    describe(ev, f);
    f.title = Object.entries(ev).filter(([k]) => k !== "id").map(([k, v]) => k + "=" + v).join("\n");
    li.append(time, ty, f);
    list.prepend(li);
    while (list.childElementCount > MAX_EVENTS) list.lastElementChild.remove();
    shown += 1;
    $("event-count").textContent = "(" + shown + " seen)";
  }

  function bytes(v) {
    const n = Number(v);
    if (!Number.isFinite(n)) return v + " bytes";
    return n >= 1048576 ? (n / 1048576).toFixed(1) + " MiB" : n >= 1024 ? (n / 1024).toFixed(1) + " KiB" : n + " bytes";
  }

  function episodeLink(v) {
    const ep = el("span", "ep", v);
    ep.dataset.episode = v;
    ep.title = "look up " + v;
    return ep;
  }

  // What an event is called on the page: its type, but a node that deregistered (a graceful
  // stop: node-down with reason "deregistered") is "node-left", not a crash's red node-down.
  function eventKind(ev) {
    if (ev.type === "node-down" && ev.reason === "deregistered") return "node-left";
    return ev.type || "other";
  }

  // One short line per event; the full fields are in the row's tooltip. Unknown types
  // and fields show as key=value, so a field the library adds is never hidden.
  function describe(ev, f) {
    const shown = new Set(["id", "type"]);
    const take = (k) => { shown.add(k); return ev[k] === undefined ? "" : String(ev[k]); };
    const parts = [];
    switch (ev.type) {
      case "claim":
      case "reassign":
        if (ev.episode !== undefined) parts.push(episodeLink(take("episode")));
        parts.push(" → " + take("device"));
        if (ev.from) parts.push(" from " + take("from"));
        take("token"); take("node"); take("from");
        break;
      case "release":
        if (ev.episode !== undefined) parts.push(episodeLink(take("episode")));
        parts.push(" ✕ " + take("device"));
        if (ev.reason) parts.push(" (" + take("reason") + ")");
        take("token"); take("reason");
        break;
      case "expire":
        parts.push(take("device") + ": " + take("count") + " idle episode(s) expired");
        break;
      case "drain":
      case "undrain":
      case "down":
      case "up":
        parts.push(take("device") + ": " + (ev.from ? take("from") + " → " : "") + take("state"));
        if (ev.reason) parts.push(" (" + take("reason") + ")");
        take("from"); take("reason");
        break;
      case "node-up":
        parts.push(take("node") + " " + (ev.devices ? take("devices").split(",").length + " device(s) " : "") + take("url"));
        break;
      case "node-leave":
        parts.push(take("node") + " is stopping gracefully: no new episodes, moving its own");
        break;
      case "node-down":
        if (ev.reason === "deregistered") {
          parts.push(take("node") + " stopped gracefully" + (ev.handed_over !== undefined
            ? ", " + take("handed_over") + " episode(s) handed over without their state" : ""));
        } else {
          parts.push(take("node") + " down" + (ev.reason ? ": " + take("reason") : ""));
        }
        take("reason"); take("lease");
        if (ev.released !== undefined) parts.push(", released " + take("released"));
        break;
      case "moved":
        if (ev.episode !== undefined) parts.push(episodeLink(take("episode")));
        parts.push(" " + take("from") + " → " + take("to") + ": moved with its state");
        if (ev.reason) parts.push(" (" + take("reason") + ")");
        if (ev.bytes !== undefined && ev.bytes !== "") parts.push(", " + bytes(take("bytes")));
        take("token"); take("model");
        break;
      case "move-kept":
        if (ev.episode !== undefined) parts.push(episodeLink(take("episode")));
        parts.push(" stayed" + (ev.device || ev.from ? " on " + (take("device") || take("from")) : "") +
          ": nothing could take it, kept with its state");
        if (ev.reason) parts.push(" (" + take("reason") + ")");
        take("token"); take("model");
        break;
      default:
        break;
    }
    for (const [k, v] of Object.entries(ev)) {
      if (shown.has(k) || v === "" || v === null || v === undefined) continue;
      parts.push(" " + k + "=" + brief(String(v)));
    }
    f.append(...parts);
  }

  // The stream is read with fetch() (EventSource cannot send the API key). When it ends or
  // is refused (503: Redis unreachable, node stopping, too many streams; 401: no key) a
  // new one resumes after the newest event shown.
  let stream = null; // the AbortController of the open stream

  function dispatch(type, data) {
    let ev = {};
    try { ev = JSON.parse(data); } catch (e) { return; }
    if (type === "gap") {
      const li = el("li", "gap", "events after " + (ev.after || "?") + " up to " +
        (ev.oldest || "?") + " may have been trimmed from the stream");
      $("event-list").prepend(li);
      return;
    }
    if (type !== "message" || !ev || !ev.id || !newer(ev.id, newest)) return; // never twice
    newest = ev.id;
    addEventRow(ev);
    schedule(Math.max(0, lastStart + EVENT_REFRESH_GAP_MS - Date.now()));
  }

  async function follow(body) { // server-sent events: "field: value" lines, blank ends one
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "", type = "message", data = [];
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, end).replace(/\r$/, "");
        buffer = buffer.slice(end + 1);
        if (line === "") {
          if (data.length) dispatch(type, data.join("\n"));
          type = "message";
          data = [];
        } else if (!line.startsWith(":")) { // a comment: a heartbeat
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (field === "event") type = text;
          else if (field === "data") data.push(text);
        }
      }
    }
  }

  async function connect() {
    if (stream) stream.abort();
    const mine = new AbortController();
    stream = mine;
    const live = $("live");
    const from = newest === "0-0" ? "backlog=" + BACKLOG : "last_event_id=" + newest;
    let wait = RECONNECT_MS;
    try {
      const r = await fetch("events/stream?" + from, {
        cache: "no-store", signal: mine.signal,
        headers: { Accept: "text/event-stream", ...keyHeaders() },
      });
      if (r.status === 401) askForKey();
      if (r.ok && r.body) {
        live.dataset.live = "live";
        live.textContent = "live";
        await follow(r.body);
        wait = RETRY_MS;
      }
    } catch (e) {
      // a dropped connection, or aborted for a new stream (then that one carries on)
    }
    if (stream !== mine) return;
    live.dataset.live = "reconnecting";
    live.textContent = "reconnecting";
    setTimeout(() => { if (stream === mine) connect(); }, wait);
  }

  // ---- episode lookup -----------------------------------------------------------------

  async function lookup(episode) {
    const out = $("lookup-result");
    out.replaceChildren();
    out.dataset.episode = episode;
    if (!episode) return;
    let res;
    try {
      res = await getJSON("episodes/" + encodeURIComponent(episode));
    } catch (e) {
      out.append(el("dd", "missing", "cannot reach this node: " + e.message));
      return;
    }
    if (res.status === 404) {
      out.dataset.found = "no";
      out.append(el("dd", "missing", "no live assignment for " + episode));
      return;
    }
    if (res.status !== 200 || !res.body) {
      out.dataset.found = "no";
      out.append(el("dd", "missing", message(res)));
      return;
    }
    out.dataset.found = "yes";
    const b = res.body;
    const fields = [
      ["episode", b.episode_id], ["device", b.device], ["node", b.node], ["token", b.token],
      ["TTL left", b.ttl_ms !== undefined ? seconds(b.ttl_ms) : undefined],
      ["state", b.state], ["owner", b.alive === undefined ? undefined : (b.alive ? "alive" : "lease lapsed")],
      ["url", b.url],
    ];
    const known = new Set(["episode_id", "device", "node", "token", "ttl_ms", "state", "alive", "url"]);
    for (const [k, v] of Object.entries(b)) if (!known.has(k)) fields.push([k, typeof v === "object" ? JSON.stringify(v) : v]);
    for (const [k, v] of fields) {
      if (v === undefined || v === null || v === "") continue;
      const dd = el("dd", null, v);
      dd.dataset.field = k === "TTL left" ? "ttl" : k;
      out.append(el("dt", null, k), dd);
    }
  }

  // ---- start --------------------------------------------------------------------------

  document.addEventListener("DOMContentLoaded", () => {
    // No <form>: a submitted password form invites the browser to save the token.
    const unlock = () => {
      const value = $("admin-token").value.trim();
      $("admin-token").value = "";
      banner("admin", null);
      setAdmin(value || null);
    };
    $("admin-unlock").addEventListener("click", unlock);
    $("admin-token").addEventListener("keydown", (e) => { if (e.key === "Enter") unlock(); });
    $("admin-lock").addEventListener("click", () => setAdmin(null));
    const setKey = () => {
      const value = $("api-key").value.trim();
      $("api-key").value = "";
      if (!value) return;
      apiKey = value;
      $("api-key").hidden = true;
      $("api-key-set").hidden = true;
      banner("key", null);
      schedule(0);
      connect();
    };
    $("api-key-set").addEventListener("click", setKey);
    $("api-key").addEventListener("keydown", (e) => { if (e.key === "Enter") setKey(); });
    $("lookup-form").addEventListener("submit", (e) => {
      e.preventDefault();
      lookup($("lookup-input").value.trim());
    });
    $("event-list").addEventListener("click", (e) => {
      const ep = e.target.closest && e.target.closest(".ep");
      if (!ep) return;
      $("lookup-input").value = ep.dataset.episode;
      lookup(ep.dataset.episode);
    });
    setAdmin(null);
    refresh();
    connect();
  });
})();
