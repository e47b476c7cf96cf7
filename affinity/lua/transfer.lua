-- transfer: move one episode to another device with its state, fenced (the live
-- hand-over, node/handover.py): "place" picks the device and reserves a slot, the owner sends
-- the record there, the new owner's "install" marks the reservation installed, "commit"
-- moves the assignment (only onto an installed copy), "abort" takes a reservation back, the
-- new owner's "settle" finds out whether a copy it holds was committed (and, if not, makes
-- sure it never will be), "kept" says that a move left the episode where it was.
--
-- KEYS[1]  {ns}:episode:<episode> (the episode id is KEYS[1] less EPISODE_KEY; the move's
--          reservation is TRANSFER_KEY .. episode: the same hash slot)
-- ARGV[1]  "place" | "commit" | "abort" | "install" | "settle" | "kept"
-- place, commit, abort (the old owner):
--   ARGV[2]  the token the owner holds the episode under
--   ARGV[3]  its claim id
--   ARGV[4]  the owner's instance (the process that holds its node's registration)
--   place:   ARGV[5] the new claim id (random hex from the caller); ARGV[6] the target: ""
--            (any device with room), a node id, or a device id; ARGV[7] how long the
--            reservation holds (ms)
--   commit:  ARGV[5] the new device, ARGV[6] the new token, ARGV[7] the new claim id,
--            ARGV[8] bytes moved and ARGV[9] why (for the event)
--   abort:   ARGV[5] the new device
-- install, settle (the new owner): ARGV[2] the new device, ARGV[3] the new token, ARGV[4]
--          the new claim id (what the record it received names)
-- kept (the old owner): ARGV[2] why it moved ("drain", "move"), ARGV[3] why it could not
--          ("none", "unreachable", "refused", "redis")
-- The owner's device and node are read from the stored value (same hash slot).
--
-- The reservation (TRANSFER_KEY .. episode, PX the hold): "<device> <token> <claim id>",
-- then " installed" once the new owner holds the copy. Returns, for place: "placed <device>
-- <token> <node> <url> <instance>": a device listed by a live node, active, serving the
-- episode's model, with room; one slot is reserved there (a load-set member that expires
-- with the reservation), a token issued and the reservation written; nothing else changed.
-- Or "refused <reason>": stale (another claim holds the episode), missing (none does),
-- marked (revoked or moved), lease (the owner's lease is not live, or another instance
-- holds it), none (no such device). For install: 1 when the reservation names that claim
-- (it is marked installed), else 0. For commit: "moved" only while the owner's claim still
-- holds the episode unmarked, its lease is live, the new device's node is alive and not
-- leaving, and the reservation names the new claim installed: the assignment becomes the
-- new claim (the backstop expiry from now), its slot moves, the reservation is deleted;
-- else "refused <reason>" (stale, missing, marked, lease, target, copy: no installed
-- copy), nothing written. For abort: 1 when a reservation's slot was taken back (the
-- reservation is deleted unless it was committed). For settle: "committed" when the
-- episode is assigned to that claim; else "dropped": the reservation of that claim, if
-- any, is deleted with its slot, so no commit can move the episode there any more. For
-- kept: 1, and a "move-kept" event.

--@lib
--@fleet

local key = KEYS[1]
local episode = string.sub(key, #EPISODE_KEY + 1)
local reservation = TRANSFER_KEY .. episode
local now_ms = clock()
local current = redis.call('GET', key)
local device, token, mark, claim, model = '', '', '', '', ''
if current then
    device, token, mark, claim, model = parse(current)
end

-- take back the slot reserved on `target` unless the episode is assigned there now
local function unreserve(target)
    if device == target then
        return 0 -- committed after all: the slot is the episode's now
    end
    local removed = redis.call('ZREM', LOAD_KEY .. target, episode)
    if removed == 1 then
        freed(target, now_ms)
    end
    return removed
end

if ARGV[1] == 'kept' then
    event('type', 'move-kept', 'episode', episode, 'device', device, 'reason', ARGV[2],
        'why', ARGV[3])
    return 1
end

if ARGV[1] == 'install' or ARGV[1] == 'settle' then
    local named = ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. ARGV[4]
    local held = redis.call('GET', reservation)
    if ARGV[1] == 'install' then
        if held ~= named then
            return 0
        end
        redis.call('SET', reservation, named .. ' installed', 'KEEPTTL')
        return 1
    end
    if current and device == ARGV[2] and token == ARGV[3] and claim == ARGV[4] then
        return 'committed'
    end
    if held == named or held == named .. ' installed' then
        redis.call('DEL', reservation)
        unreserve(ARGV[2])
    end
    return 'dropped'
end

if ARGV[1] == 'abort' then
    local held = redis.call('GET', reservation)
    if held and string.sub(held, 1, #ARGV[5] + 1) == ARGV[5] .. ' ' and device ~= ARGV[5] then
        redis.call('DEL', reservation)
    end
    return unreserve(ARGV[5])
end

if not current then
    return 'refused missing'
end

if token ~= ARGV[2] or claim ~= ARGV[3] then
    return 'refused stale'
end
if mark ~= '' then
    return 'refused marked'
end
local owner = redis.call('HGET', DEVICE_KEY .. device, 'node')
if not owner or not alive(owner, now_ms)
    or (redis.call('HGET', NODE_KEY .. owner, 'instance') or '') ~= ARGV[4] then
    return 'refused lease'
end

-- does the listed device serve model m, is it usable, how many slots are taken?
local function room(candidate)
    local node, state, cap, _, url = route(candidate)
    if not node or not usable(node, state) or candidate == device then
        return nil
    end
    if model ~= '' then
        local models = ',' .. (redis.call('HGET', NODE_KEY .. node, 'models') or '') .. ','
        if not string.find(models, ',' .. model .. ',', 1, true) then
            return nil
        end
    end
    sweep(candidate, now_ms)
    local live = redis.call('ZCARD', LOAD_KEY .. candidate)
    if live >= cap then
        return nil
    end
    return node, url, live, cap
end

if ARGV[1] == 'place' then
    local target, chosen, node, url, cap = ARGV[6], nil, nil, nil, nil
    if target == '' then
        -- the first few of the model's ring, lowest turn first (draining, down and leaving
        -- devices are not in it): no scan of the fleet
        local ring = model == '' and RING or RING_KEY .. model
        for _, candidate in ipairs(redis.call('ZRANGE', ring, 0, 7)) do
            local n, u, _, c = room(candidate)
            if n then
                chosen, node, url, cap = candidate, n, u, c
                break
            end
        end
    elseif string.find(target, '/', 1, true) then
        local n, u, _, c = room(target)
        if n then
            chosen, node, url, cap = target, n, u, c
        end
    else -- a node: its least loaded device that takes the episode
        local fewest
        for _, candidate in ipairs(node_devices(target)) do
            local n, u, live, c = room(candidate)
            if n and (not fewest or live < fewest) then
                chosen, node, url, cap, fewest = candidate, n, u, c, live
            end
        end
    end
    if not chosen then
        return 'refused none'
    end
    local t = redis.call('TIME')
    local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
    local issued = int(now_us)
    local last = tonumber(redis.call('SET', TOKEN, issued, 'GET') or '0')
    if last >= now_us then
        issued = int(last + 1)
        redis.call('SET', TOKEN, issued)
    end
    local load = LOAD_KEY .. chosen
    redis.call('ZADD', load, int(now_ms + tonumber(ARGV[7])), episode)
    redis.call('SET', reservation, chosen .. ' ' .. issued .. ' ' .. ARGV[5], 'PX', ARGV[7])
    if redis.call('ZCARD', load) >= cap then
        to_full(chosen, load)
    end
    return 'placed ' .. chosen .. ' ' .. issued .. ' ' .. node .. ' ' .. url .. ' '
        .. (redis.call('HGET', NODE_KEY .. node, 'instance') or '')
end

-- commit
local target, issued, fresh = ARGV[5], ARGV[6], ARGV[7]
local node = route(target)
if not node or not alive(node, now_ms)
    or redis.call('HGET', NODE_KEY .. node, 'state') == 'leaving' then
    return 'refused target'
end
if redis.call('GET', reservation) ~= target .. ' ' .. issued .. ' ' .. fresh .. ' installed' then
    return 'refused copy' -- the new owner never installed it, or dropped its copy (settle)
end
redis.call('DEL', reservation)
local deadline = int(now_ms + TTL)
redis.call('SET', key, value(target, issued, fresh, model), 'PXAT', deadline)
redis.call('ZREM', LOAD_KEY .. device, episode)
freed(device, now_ms)
local load = LOAD_KEY .. target
redis.call('ZADD', load, deadline, episode)
event('type', 'moved', 'episode', episode, 'from', device, 'to', target, 'token', issued,
    'bytes', ARGV[8], 'reason', ARGV[9], 'model', model)
return 'moved'
