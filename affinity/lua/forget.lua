-- forget: an operator removes what is known about a dead node (its record, its devices).
--
-- KEYS[1]  {ns}:node:<node> (the node id is KEYS[1] less NODE_KEY)
--
-- Episodes still assigned to its devices are reassigned on their next request.
-- Returns 1 when forgotten, 0 when nothing is known about the node, -1 when it holds a
-- current lease (nothing written: stop it first).

--@lib
--@fleet

local node = string.sub(KEYS[1], #NODE_KEY + 1)
notice_lapses(clock())
if redis.call('ZSCORE', NODES, node) then
    return -1
end
local devices = indexed_devices(node)
if #devices == 0 and redis.call('EXISTS', KEYS[1]) == 0 then
    return 0
end
for _, device in ipairs(devices) do
    remove_device(device)
end
redis.call('DEL', KEYS[1])
event('type', 'node-forget', 'node', node, 'devices', table.concat(devices, ','))
return 1
