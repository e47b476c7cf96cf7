-- deregister: end a node's lease and release every episode its devices hold.
--
-- KEYS[1]  {ns}:node:<node>
-- KEYS[2]  {ns}:nodes
-- KEYS[3]  {ns}:events
-- ARGV[1]  node id
-- ARGV[2]  key prefix "{ns}:"; load sets and episode keys are derived from the node's
--          device list and the load sets' members (same hash tag, same slot).
-- ARGV[3]  approximate MAXLEN of the events stream
-- ARGV[4]  instance id of the process ("" = not checked); another instance's
--          registration is left alone (returns -1)
--
-- Device hashes stay, so an operator's drain survives a restart.
-- Returns the number of episodes released.

local prefix = ARGV[2]
local holder = redis.call('HGET', KEYS[1], 'instance')
if holder and holder ~= '' and ARGV[4] ~= '' and holder ~= ARGV[4] then
    return -1
end
local released = 0
local devices = redis.call('HGET', KEYS[1], 'devices') or ''
for device in string.gmatch(devices, '[^,]+') do
    local load_key = prefix .. 'load:' .. device
    for _, episode in ipairs(redis.call('ZRANGE', load_key, 0, -1)) do
        local key = prefix .. 'episode:' .. episode
        local current = redis.call('GET', key)
        if current and string.sub(current, 1, #device + 1) == device .. ' ' then
            redis.call('DEL', key)
            released = released + 1
        end
    end
    redis.call('DEL', load_key)
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*',
    'type', 'node-down', 'node', ARGV[1], 'released', released)
return released
