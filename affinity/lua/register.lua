-- register: (re)register a node and its devices and start its lease.
--
-- KEYS[1]  {ns}:node:<node>  hash url, devices, started_at, version, instance, state, models,
--          procs, lease
--          (the node id is KEYS[1] less NODE_KEY)
-- ARGV[1]  advertise URL
-- ARGV[2]  software version
-- ARGV[3]  instance id of the registering process ("" = not checked)
-- ARGV[4]  the models every device of the node serves, "name@version,..." ("" = none: the
--          devices take episodes from the one RING); a version seen for the first time is
--          added to VERSIONS_KEY .. name with this time (the newest takes new episodes
--          unless the operator set weights)
-- ARGV[5]  the longest lease TTL (ms) the node has heard of (0: none yet)
-- ARGV[6]  the node's shape and processes (JSON, written as given to the procs field; "" =
--          none: the record reads as one process)
-- ARGV[7]  n, the number of devices
-- ARGV[8..] 11 fields per device (n times): index, kind, name, uuid, arch, memory,
--          capacity, weight, provider, state ("active" or "down", from the node's crash
--          tracker), reason; then 5 fields per episode the node still serves from memory
--          (re-registering within its lease, after Redis lost its data): episode, device,
--          token, claim id, model ("name@version", "" = none)
--
-- The episodes are re-asserted: each one whose assignment is missing is written again (the
-- same value, model included, the backstop expiry) and counted in its device's load set
-- (a device it fills leaves the rings of all its models for full); one that Redis holds
-- with the same value is kept (an operator's " revoked" mark too: the renewal carries it
-- out); one that Redis gives to another claim (or that is on a
-- device not registered now, or of a model the node no longer serves) is answered as lost:
-- the node drops it. A missing fleet marker starts the grace period (lib.lua) in which no
-- claim is granted meanwhile, so no other node can have claimed an episode that is
-- re-asserted within it.
-- An operator's drain (state "draining" and its reason) survives re-registration while
-- the same GPU UUID sits at that index; a device the node registers "down" stays down
-- and returns to that drain when it comes back up. Every device of this node id that the
-- devices index holds and the node no longer registers is removed (its episodes are
-- reassigned on their next request). Two processes must never hold one node id: while
-- another instance's lease is current, nothing is written and -1 is returned.
-- Returns {lease deadline (ms, server time), grace ms left (0: none), the lease granted
-- (ms: fleet.lua's lease_terms), the longest lease TTL of the fleet (ms), lost
-- episode...}, or {-1}.

--@lib
--@fleet

local node, url = string.sub(KEYS[1], #NODE_KEY + 1), ARGV[1]
local now_ms = clock()
notice_lapses(now_ms)
if held_by_other(node, ARGV[3], now_ms) then
    return {-1}
end
local grace = recovering(now_ms, ARGV[5]) or 0

local listed, ids = {}, {}
local last = 7 + 11 * tonumber(ARGV[7])
for i = 8, last, 11 do
    local id = node .. '/' .. ARGV[i]
    local key = DEVICE_KEY .. id
    unenroll(id) -- out of the rings of the models it served until now
    local old = redis.call('HMGET', key, 'state', 'reason', 'uuid', 'prev_state', 'prev_reason')
    -- the drain belongs to the physical GPU: it carries over only while the same UUID sits
    -- at this index (GPU order can change across reboots)
    local drain = nil
    if old[3] == ARGV[i + 3] or not old[3] then
        if old[1] == 'draining' then
            drain = old[2] or ''
        elseif old[1] == 'down' and old[4] == 'draining' then
            drain = old[5] or ''
        end
    end
    local state, reason = 'active', ''
    redis.call('HDEL', key, 'prev_state', 'prev_reason')
    if ARGV[i + 9] == 'down' then
        state, reason = 'down', ARGV[i + 10]
        redis.call('HSET', key, 'prev_state', drain and 'draining' or 'active', 'prev_reason', drain or '')
    elseif drain then
        state, reason = 'draining', drain
    end
    redis.call('HSET', key,
        'node', node, 'index', ARGV[i], 'kind', ARGV[i + 1], 'name', ARGV[i + 2],
        'uuid', ARGV[i + 3], 'arch', ARGV[i + 4], 'memory', ARGV[i + 5],
        'capacity', ARGV[i + 6], 'weight', ARGV[i + 7], 'provider', ARGV[i + 8],
        'state', state, 'reason', reason)
    redis.call('SADD', DEVICES, id)
    set_route(id, node, state, ARGV[i + 6], ARGV[i + 7], url)
    listed[id] = true
    ids[#ids + 1] = id
end

-- devices of this node id it no longer has, found through the index (not the old hash,
-- which a deregistration deleted)
for _, id in ipairs(indexed_devices(node)) do
    if not listed[id] then
        remove_device(id)
    end
end

redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'url', url, 'devices', table.concat(ids, ','),
    'started_at', int(now_ms), 'version', ARGV[2], 'instance', ARGV[3], 'state', 'up',
    'models', ARGV[4])
if ARGV[6] ~= '' then
    redis.call('HSET', KEYS[1], 'procs', ARGV[6])
end
for m in string.gmatch(ARGV[4], '[^,]+') do
    local name, version = string.match(m, '^(.*)@(.*)$')
    redis.call('ZADD', VERSIONS_KEY .. name, 'NX', int(now_ms), version)
end
local granted, longest = lease_terms(node, ARGV[5])
redis.call('ZADD', NODES, int(now_ms + granted), node)
local lost = {}
local deadline = int(now_ms + TTL)
local served = ',' .. ARGV[4] .. ','
for i = last + 1, #ARGV, 5 do
    local episode, device, model, want, current = held_at(i)
    local serves = model == '' or string.find(served, ',' .. model .. ',', 1, true)
    local revoked = current == want .. ' revoked'
    if listed[device] and serves and (not current or current == want or revoked) then
        slide(episode, device, current or want, deadline)
    else
        lost[#lost + 1] = episode
    end
end
for _, id in ipairs(ids) do
    unenroll(id) -- re-enter at the current virtual time, with the weight registered now
    enroll(id, now_ms)
end
event('type', 'node-up', 'node', node, 'url', url, 'devices', table.concat(ids, ','),
    'models', ARGV[4])
return {int(now_ms + granted), int(grace), int(granted), int(longest), unpack(lost)}
