-- renew: extend a node's lease, only while it is still registered.
--
-- KEYS[1]  {ns}:node:<node>
-- KEYS[2]  {ns}:nodes
-- ARGV[1]  node id
-- ARGV[2]  lease TTL in milliseconds
-- ARGV[3]  instance id of the renewing process ("" = not checked)
--
-- Returns the new lease deadline (ms, server time), or -1 when the node hash is gone
-- (the lease lapsed, or Redis restarted empty) or belongs to another instance: the node
-- must register again.

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local holder = redis.call('HGET', KEYS[1], 'instance')
if not holder or (ARGV[3] ~= '' and holder ~= '' and holder ~= ARGV[3]) then
    return -1
end
local lease = tonumber(ARGV[2])
redis.call('PEXPIRE', KEYS[1], lease)
redis.call('ZADD', KEYS[2], now_ms + lease, ARGV[1])
return now_ms + lease
