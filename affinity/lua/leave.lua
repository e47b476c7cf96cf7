-- leave: a graceful stop begins: the node's devices take no new episodes; the episodes
-- they hold stay (and their hits too) until handed over or the node deregisters.
--
-- KEYS[1]  {ns}:node:<node> (the node id is KEYS[1] less NODE_KEY)
-- ARGV[1]  instance id of the leaving process ("" = not checked)
--
-- The lease keeps being renewed until deregistration; re-registering undoes a leave.
-- Returns how many devices stopped taking episodes; -1 when another instance holds the
-- node id (nothing written); 0 when the node is not registered.

--@lib
--@fleet

local node = string.sub(KEYS[1], #NODE_KEY + 1)
if held_by_other(node, ARGV[1], clock()) then
    return -1
end
if redis.call('HGET', KEYS[1], 'state') ~= 'up' then
    return 0
end
redis.call('HSET', KEYS[1], 'state', 'leaving')
local devices = node_devices(node)
for _, device in ipairs(devices) do
    unenroll(device)
end
event('type', 'node-leave', 'node', node)
return #devices
