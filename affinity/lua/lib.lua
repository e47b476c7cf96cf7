-- lib: what every script uses. affinity/scripts.py puts it where a script says `--@lib`,
-- after the header of constants it generates for the deployment: PREFIX, the fixed keys
-- NODES RING FULL ROUTE EVENTS DEVICES TOKEN RR MARKER LEASES KNOWN, the key prefixes
-- EPISODE_KEY NODE_KEY DEVICE_KEY LOAD_KEY MOVED_KEY REVOKED_KEY MOVES_KEY TRANSFER_KEY RING_KEY
-- VERSIONS_KEY ROLLOUT_KEY PICKS_KEY, the placement keys SCORES SCORE_KEY SCORED HASHRING
-- HASHRING_KEY VIEW, TTL, LEASE (this caller's lease TTL, ms), MAXLEN, and the value
-- formats VALUE and ROUTED. Every
-- key shares the namespace hash tag, hence one slot: scripts derive keys from ids
-- (LOAD_KEY .. device) safely on Redis Cluster too. The ring and full upkeep is in
-- fleet.lua (`--@fleet`), kept apart so that the common claim does not pay for making it.

-- integers as commands want them: a Lua number reaches Redis as %.17g (7.0) or as its
-- shortest form (7.2 and later), which is 1.796e+12 for a time that ends in zeros
local function int(x)
    return string.format('%.0f', x)
end

-- Redis server time in milliseconds
local function clock()
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function event(...)
    redis.call('XADD', EVENTS, 'MAXLEN', '~', MAXLEN, '*', ...)
end

-- an episode value: "<device> <token> <claim id> <model>" (model "name@version"; no model
-- when its node registered none, no claim id when written by an older fleet), then a mark:
-- " revoked" while an operator's release waits for its owner to let go (release.lua), or
-- " moved" once it let go (a hand-over, a carried-out revocation): the next resolve
-- reassigns it. Returns device, token, mark ('', 'revoked' or 'moved'), claim id, model,
-- and the value without its mark.
local function parse(value)
    local device, token, rest = string.match(value, VALUE)
    local mark = ''
    if string.sub(rest, -6) == ' moved' then
        mark, rest = 'moved', string.sub(rest, 1, -7)
    elseif string.sub(rest, -8) == ' revoked' then
        mark, rest = 'revoked', string.sub(rest, 1, -9)
    end
    return device, token, mark, string.match(rest, '^ (%x+)') or '',
        string.match(rest, '^ %x+ (%S+@%S+)') or '', device .. ' ' .. token .. rest
end

-- the value an owner's re-assert (register.lua) or slide (flush.lua) writes for a claim it
-- holds: the same as resolve.lua wrote for it
local function value(device, token, claim, model)
    return device .. ' ' .. token .. (claim ~= '' and ' ' .. claim or '')
        .. (model ~= '' and ' ' .. model or '')
end

-- a < b in byte order (Lua's < follows the server's locale; Redis sorts members bytewise)
local function before(a, b)
    for i = 1, math.min(#a, #b) do
        local x, y = string.byte(a, i), string.byte(b, i)
        if x ~= y then
            return x < y
        end
    end
    return #a < #b
end

-- The rings a node's devices take new episodes from: one per model the node serves
-- (RING_KEY .. "name@version", from its record's `models`), or the one RING of a fleet
-- whose nodes register no model. The node is the device id less "/<index>".
local function node_rings(node)
    local models = redis.call('HGET', NODE_KEY .. node, 'models')
    if not models or models == '' then
        return {RING}
    end
    local out = {}
    for m in string.gmatch(models, '[^,]+') do
        out[#out + 1] = RING_KEY .. m
    end
    return out
end

local function rings(device)
    return node_rings(string.match(device, '^(.*)/[^/]*$') or device)
end

-- node, state, capacity, weight, url of a device listed by its node; nil when not listed
local function route(device)
    local r = redis.call('HGET', ROUTE, device)
    if not r then
        return nil
    end
    local node, state, cap, weight, url = string.match(r, ROUTED)
    return node, state, tonumber(cap), tonumber(weight), url
end

-- drop idle-expired members of a device's load set (live = deadline >= now)
local function sweep(device, now_ms)
    local n = redis.call('ZREMRANGEBYSCORE', LOAD_KEY .. device, '-inf', '(' .. int(now_ms))
    if n > 0 then
        event('type', 'expire', 'device', device, 'count', n)
    end
end

-- Scored placement (docs/policies.md): beside each ring, its score index (device ->
-- predicted step time in ms / weight, published at renewals, moved by each claim) and its
-- hash ring (device -> a hash of its id: bounded-load consistent hashing of re-claims).
-- Both hold only members of the ring: they enter and leave with it.
local function index_of(ring)
    return ring == RING and SCORES or SCORE_KEY .. string.sub(ring, #RING_KEY + 1)
end

local function hashring_of(ring)
    return ring == RING and HASHRING or HASHRING_KEY .. string.sub(ring, #RING_KEY + 1)
end

-- a point on the hash ring: 32 bits of an id (djb2, then a multiplicative mix so that ids
-- that differ in one character land far apart; exact in a double: no product passes 2^53)
local function hash_of(id)
    local h = 5381
    for i = 1, #id do
        h = (h * 33 + string.byte(id, i)) % 4294967296
    end
    local hi, lo = math.floor(h / 65536), h % 65536
    return ((hi * 31153 % 65536) * 65536 + lo * 2654435761) % 4294967296
end

-- a device's last published score, "<expires ms> <step ms> <cost ms>" in SCORED: its
-- expiry, step time and cost as numbers; nil when none was published
local function published(device)
    local v = redis.call('HGET', SCORED, device)
    if not v then
        return nil
    end
    local expires, step, cost = string.match(v, '^(%d+) (%S+) (%S+)$')
    return tonumber(expires), tonumber(step), tonumber(cost)
end

-- out of one ring and its score index and hash ring
local function leave_ring(ring, device)
    redis.call('ZREM', ring, device)
    redis.call('ZREM', index_of(ring), device)
    redis.call('ZREM', hashring_of(ring), device)
end

-- a device at capacity leaves the rings of all its models for full, scored by its earliest
-- idle deadline
local function to_full(device, load)
    for _, ring in ipairs(rings(device)) do
        leave_ring(ring, device)
    end
    redis.call('ZADD', FULL, redis.call('ZRANGE', load, 0, 0, 'WITHSCORES')[2], device)
end

-- The fleet marker (MARKER) holds the end of the grace period after Redis lost its data
-- ("0": none), then the end of the doubt that follows it. Its absence means Redis lost its
-- data (restarted empty, or failed over to a replica that never had it) or the fleet is new:
-- the first script that finds it missing starts a grace period as long as the longest lease
-- any node may hold: the caller's own (LEASE) or the longest it heard of at its last renewal
-- (`known`, ms; fleet.lua's lease_terms grants no node a lease longer than every leased node
-- has heard of). During it no claim is granted (owners that may still serve an episode
-- re-register and re-assert their episodes first). For one backstop (TTL) after it, Redis
-- cannot tell an episode it never saw from one it lost with an owner that died meanwhile:
-- a claim then is a reassignment (resolve.lua: the client is told state_reset). Returns
-- the ms left of the grace period (nil when there is none), and whether the doubt lasts.
local function recovering(now_ms, known)
    local marker = redis.call('GET', MARKER)
    if not marker then
        local length = math.max(LEASE, tonumber(known) or 0)
        redis.call('SET', MARKER, int(now_ms + length) .. ' ' .. int(now_ms + length + TTL))
        event('type', 'recovering', 'until', int(now_ms + length),
            'reason', 'fleet marker missing: Redis lost its data, or the fleet is new')
        return length, true
    end
    local grace, doubt = string.match(marker, '^(%d+) ?(%d*)$')
    local left = tonumber(grace or '0') - now_ms
    local doubting = doubt ~= nil and doubt ~= '' and tonumber(doubt) > now_ms
    if left > 0 then
        return left, doubting
    end
    return nil, doubting
end
