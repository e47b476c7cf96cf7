-- renew: extend a node's lease, only while it is still registered by this process.
--
-- KEYS[1]  {ns}:node:<node> (the node id is KEYS[1] less NODE_KEY)
-- ARGV[1]  instance id of the renewing process ("" = not checked)
-- ARGV[2..] "<episode> <token>" revocations the owner carried out since they were last
--          answered (removed now: one whose answer was lost comes back, never goes missing)
--
-- Every renewal notices the leases (its own or any other node's) that ran out (once, see
-- lib.lua) and keeps the scores of its models' rings small.
-- Returns {the new lease deadline (ms, server time), "<episode> <token>"...}: the node's
-- assignments someone else released in Redis (release.lua) not yet carried out: the
-- owner drops their records and says so at its next renewal; {-1} when the node holds no lease (it lapsed, the
-- node deregistered, or Redis lost its data): register again; {-2} when another instance
-- holds the node id with a current lease (nothing written).

--@lib
--@fleet

local node = string.sub(KEYS[1], #NODE_KEY + 1)
local now_ms = clock()
recovering(now_ms) -- a renewal is often the first to find that Redis lost its data
notice_lapses(now_ms)
for _, ring in ipairs(node_rings(node)) do
    rebase(ring)
end
if held_by_other(node, ARGV[1], now_ms) then
    return {-2}
end
if not alive(node, now_ms) or redis.call('EXISTS', KEYS[1]) == 0 then
    return {-1}
end
redis.call('ZADD', NODES, int(now_ms + LEASE), node)
local revoked_key = REVOKED_KEY .. node
for i = 2, #ARGV do
    redis.call('SREM', revoked_key, ARGV[i])
end
local revoked = redis.call('SMEMBERS', revoked_key)
if #revoked > 0 then -- kept while this owner renews; gone with it
    redis.call('PEXPIREAT', revoked_key, int(now_ms + 2 * LEASE))
end
return {int(now_ms + LEASE), unpack(revoked)}
