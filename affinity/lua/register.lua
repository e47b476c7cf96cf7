-- register: (re)register a node and its devices and start its lease.
--
-- KEYS[1]  {ns}:node:<node>   hash url, devices, started_at, version; PX = lease TTL
-- KEYS[2]  {ns}:nodes         zset node -> lease deadline (ms, server time)
-- KEYS[3]  {ns}:devices       set of every registered device id
-- KEYS[4]  {ns}:events
-- ARGV[1]  node id
-- ARGV[2]  advertise URL
-- ARGV[3]  lease TTL in milliseconds
-- ARGV[4]  key prefix "{ns}:"; device hashes {ns}:device:<node>/<index> are derived
--          (same hash tag, same slot).
-- ARGV[5]  approximate MAXLEN of the events stream
-- ARGV[6]  software version
-- ARGV[7]  instance id of the registering process ("" = not checked)
-- ARGV[8..] 9 fields per device: index, kind, name, uuid, arch, memory, capacity, weight, provider
--
-- An operator's drain (state "draining" and its reason) survives re-registration while
-- the same GPU UUID sits at that index; a crash-tracker "down" does not (a new process
-- starts healthy). Devices the node listed
-- before but not now are removed, so their episodes move on their next request.
-- Two processes must never hold one node id (they would serve the same devices): while
-- the lease of another instance is current, nothing is written and -1 is returned.
-- Returns the lease deadline (ms, server time), or -1.

local prefix = ARGV[4]
local node = ARGV[1]
local lease = tonumber(ARGV[3])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local holder = redis.call('HGET', KEYS[1], 'instance')
if holder and holder ~= '' and ARGV[7] ~= '' and holder ~= ARGV[7] then
    local deadline = redis.call('ZSCORE', KEYS[2], node)
    if deadline and tonumber(deadline) > now_ms then
        return -1
    end
end

local listed = {}
local ids = {}
for i = 8, #ARGV, 9 do
    local id = node .. '/' .. ARGV[i]
    local key = prefix .. 'device:' .. id
    local old = redis.call('HMGET', key, 'state', 'reason', 'uuid', 'prev_state', 'prev_reason')
    local state, reason = 'active', ''
    -- the drain belongs to the physical GPU: it carries over only while the same UUID
    -- sits at this index (GPU order can change across reboots); a device that was down
    -- goes back to the drain it had before going down
    if old[3] == ARGV[i + 3] or not old[3] then
        if old[1] == 'draining' then
            state, reason = 'draining', old[2] or ''
        elseif old[1] == 'down' and old[4] == 'draining' then
            state, reason = 'draining', old[5] or ''
        end
    end
    redis.call('HDEL', key, 'prev_state', 'prev_reason')
    redis.call('HSET', key,
        'node', node, 'index', ARGV[i], 'kind', ARGV[i + 1], 'name', ARGV[i + 2],
        'uuid', ARGV[i + 3], 'arch', ARGV[i + 4], 'memory', ARGV[i + 5],
        'capacity', ARGV[i + 6], 'weight', ARGV[i + 7], 'provider', ARGV[i + 8],
        'state', state, 'reason', reason)
    redis.call('SADD', KEYS[3], id)
    listed[id] = true
    ids[#ids + 1] = id
end

local before = redis.call('HGET', KEYS[1], 'devices')
if before then
    for id in string.gmatch(before, '[^,]+') do
        if not listed[id] then
            redis.call('DEL', prefix .. 'device:' .. id)
            redis.call('SREM', KEYS[3], id)
        end
    end
end

redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'url', ARGV[2], 'devices', table.concat(ids, ','),
    'started_at', now_ms, 'version', ARGV[6], 'instance', ARGV[7])
redis.call('PEXPIRE', KEYS[1], lease)
redis.call('ZADD', KEYS[2], now_ms + lease, node)
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[5], '*',
    'type', 'node-up', 'node', node, 'url', ARGV[2], 'devices', table.concat(ids, ','))
return now_ms + lease
