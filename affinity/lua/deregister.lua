-- deregister: end a node's lease; every episode it still holds is handed over.
--
-- KEYS[1]  {ns}:node:<node> (the node id is KEYS[1] less NODE_KEY)
-- ARGV[1]  instance id of the process ("" = not checked)
--
-- Each live episode of the node's devices (found through their load sets) is left as
-- "<device> <token> moved" (same expiry): its next resolve says "reassigned", previous =
-- that device, so its client is told its state was reset whether or not it echoes
-- tokens; it is listed in the device's moved set until then. Device hashes stay, so an operator's drain survives a restart; the node hash
-- stays with state "left" (so `affinity nodes` and `affinity devices` agree: the devices
-- are listed, not alive, under a node that left) until the node registers again or an
-- operator forgets it.
-- Returns the number of episodes handed over; -1 when another instance holds the node id
-- (nothing written).

--@lib
--@fleet

local node = string.sub(KEYS[1], #NODE_KEY + 1)
local now_ms = clock()
if held_by_other(node, ARGV[1], now_ms) then
    return -1
end
local handed = 0
for _, device in ipairs(node_devices(node)) do
    unenroll(device)
    redis.call('HDEL', ROUTE, device)
    local load = LOAD_KEY .. device
    local live = redis.call('ZRANGEBYSCORE', load, int(now_ms), '+inf', 'WITHSCORES')
    for i = 1, #live, 2 do
        local episode = live[i]
        local key = EPISODE_KEY .. episode
        local current = redis.call('GET', key)
        if current then
            local holder, _, mark, _, _, base = parse(current)
            if holder == device and mark ~= 'moved' then
                redis.call('SET', key, base .. ' moved', 'KEEPTTL')
                moved_from(device, episode, live[i + 1], now_ms)
                handed = handed + 1
            end
        end
    end
    redis.call('DEL', load)
end
local was_leased = redis.call('ZREM', NODES, node) == 1
redis.call('ZREM', LEASES, node)
redis.call('ZREM', KNOWN, node)
if redis.call('EXISTS', KEYS[1]) == 1 then
    redis.call('HSET', KEYS[1], 'state', 'left', 'lease', int(now_ms))
end
if was_leased then
    event('type', 'node-down', 'node', node, 'reason', 'deregistered', 'handed_over', handed)
end
return handed
