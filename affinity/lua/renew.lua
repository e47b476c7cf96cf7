-- renew: extend a node's lease, only while it is still registered.
--
-- KEYS[1]  {ns}:node:<node>
-- KEYS[2]  {ns}:nodes
-- ARGV[1]  node id
-- ARGV[2]  lease TTL in milliseconds
--
-- Returns the new lease deadline (ms, server time), or -1 when the node hash is gone
-- (the lease lapsed, or Redis restarted empty): the node must register again.

local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('EXISTS', KEYS[1]) == 0 then
    return -1
end
local lease = tonumber(ARGV[2])
redis.call('PEXPIRE', KEYS[1], lease)
redis.call('ZADD', KEYS[2], now_ms + lease, ARGV[1])
return now_ms + lease
