-- renew: extend a node's lease, only while it is still registered by this process.
--
-- KEYS[1]  {ns}:node:<node> (the node id is KEYS[1] less NODE_KEY)
-- ARGV[1]  instance id of the renewing process ("" = not checked)
-- ARGV[2]  the longest lease TTL (ms) the node has heard of (its last renewal's answer)
-- ARGV[3]  the node's shape and processes (JSON, written as given to the node's procs
--          field; "" = left as it is)
-- ARGV[4]  n, the scores the node publishes (scored placement: docs/policies.md), then 3
--          fields per score: device index, step ms (the step time a new episode would see
--          there), cost ms (how much one more episode adds to it)
-- ARGV[5+3n..] "<episode> <token>" revocations the owner carried out (it dropped the record)
--          since they were last answered: removed now (one whose answer was lost comes
--          back, never goes missing), and an assignment still marked " revoked" under that
--          token becomes " moved" (its slot freed): its next resolve reassigns it. The
--          episode's key is derived here (EPISODE_KEY .. episode: the same hash slot).
--
-- Each score is kept in SCORED (expiring with the lease granted now: a node that stops
-- publishing ages out) and, for a device its rings hold (active, with room), in their
-- score indexes as step / weight.
-- Every renewal notices the leases (its own or any other node's) that ran out (once, see
-- lib.lua) and keeps the scores of its models' rings small.
-- Returns {the new lease deadline (ms, server time), the lease granted (ms), the longest
-- lease TTL of the fleet (ms), n, then n "<episode> <token>": the node's assignments
-- someone else released in Redis (release.lua) not yet carried out: the owner drops their
-- records and says so (ARGV[5+3n..]); then the moves an operator asked of the node
-- (MOVES_KEY .. node, read and removed: "@<device>" or "<episode>\x1f<target>")}; {-1}
-- when the node holds no lease (it lapsed, the node deregistered, or Redis lost its data):
-- register again; {-2} when another instance holds
-- the node id with a current lease (nothing written). The granted lease is the node's own
-- TTL unless the fleet has not heard of it yet (fleet.lua's lease_terms).

--@lib
--@fleet

local node = string.sub(KEYS[1], #NODE_KEY + 1)
local now_ms = clock()
recovering(now_ms, ARGV[2]) -- a renewal is often the first to find that Redis lost its data
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
local granted, longest = lease_terms(node, ARGV[2])
redis.call('ZADD', NODES, int(now_ms + granted), node)
if ARGV[3] ~= '' then
    redis.call('HSET', KEYS[1], 'procs', ARGV[3])
end
local scored = tonumber(ARGV[4]) or 0
local first = 5 + 3 * scored -- the first revocation
if scored > 0 then
    local expires = int(now_ms + granted)
    local own = node_rings(node)
    for i = 5, first - 1, 3 do
        local device = node .. '/' .. ARGV[i]
        local step, cost = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
        local _, _, _, weight = route(device)
        if step and cost and weight then
            redis.call('HSET', SCORED, device, expires .. ' ' .. ARGV[i + 1] .. ' ' .. ARGV[i + 2])
            for _, ring in ipairs(own) do
                if redis.call('ZSCORE', ring, device) then
                    redis.call('ZADD', index_of(ring), step / weight, device)
                end
            end
        end
    end
end
local revoked_key = REVOKED_KEY .. node
for i = first, #ARGV do
    redis.call('SREM', revoked_key, ARGV[i])
    local episode, token = string.match(ARGV[i], '^(.*) (%d+)$')
    local key = EPISODE_KEY .. episode
    local current = episode and redis.call('GET', key)
    if current then
        local device, held, mark, _, _, base = parse(current)
        if mark == 'revoked' and held == token then
            hand_over(key, episode, device, base, now_ms)
            event('type', 'release', 'episode', episode, 'device', device, 'token', token,
                'reason', 'revoked')
        end
    end
end
local revoked = redis.call('SMEMBERS', revoked_key)
if #revoked > 0 then -- kept while this owner renews; gone with it
    redis.call('PEXPIREAT', revoked_key, int(now_ms + 2 * granted))
end
local reply = {int(now_ms + granted), int(granted), int(longest), #revoked, unpack(revoked)}
local moves = redis.call('SMEMBERS', MOVES_KEY .. node)
if #moves > 0 then
    redis.call('DEL', MOVES_KEY .. node)
    for _, move in ipairs(moves) do
        reply[#reply + 1] = move
    end
end
return reply
