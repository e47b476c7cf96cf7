-- fleet: the upkeep of the ring and full (after lib.lua, where a script says `--@fleet`).
--
-- The structures:
--   NODES  zset node -> lease deadline (ms, server time): nodes holding a lease
--   RING   zset device -> picks / weight: the devices that take new episodes; one ring per
--          model ("name@version", RING_KEY .. model) that a device's node serves, each
--          with scores of its own (rings(device), lib.lua)
--   FULL   zset device -> earliest idle deadline in its load set (ms)
--   ROUTE  hash device -> "node state capacity weight url", devices listed by a leased node
--   the score index and hash ring of each ring (lib.lua): members of the ring only
--
-- A device is enrolled (in the ring or in full, never both) while its node holds a lease,
-- is up (not leaving), lists it, and the device is active. Enrolled with live load below
-- capacity: ring; at capacity: full. Draining, down and leaving devices, and the devices
-- of a dead node, are in neither.
--
-- The ring is stride scheduling: a device of weight w picked k times is scored k/w; a claim
-- takes the lowest score (equal scores: the lower member in byte order, which is how Redis
-- orders them) and re-scores it (k+1)/w, computed afresh from integers, so equal rationals
-- tie exactly. Over any W = sum-of-weights consecutive claims with an unchanged ring, each
-- device is picked exactly w times (see docs/internals.md, "The claim").

local function set_route(device, node, state, cap, weight, url)
    redis.call('HSET', ROUTE, device, node .. ' ' .. state .. ' ' .. cap .. ' ' .. weight .. ' ' .. url)
end

local function alive(node, now_ms)
    local deadline = redis.call('ZSCORE', NODES, node)
    return deadline and tonumber(deadline) > now_ms
end

-- may this listed device take new episodes (capacity aside)? Listed means its node holds
-- a lease (a lapse is taken out of ROUTE when it is noticed); up means not leaving.
local function usable(node, state)
    return state == 'active' and redis.call('HGET', NODE_KEY .. node, 'state') == 'up'
end

-- The score that makes a device joining the ring take its turns from now on: k = how many
-- of its turns (j/w for j = 0, 1, ...) come before the next turn to be taken (the ring's
-- lowest member), as if it had always been there. The others' turns are unchanged, so the
-- sequence of picks stays the merge of every member's turns.
local function join_score(ring, device, weight)
    while true do
        local m = redis.call('ZRANGE', ring, 0, 0, 'WITHSCORES')
        if #m == 0 then
            return 0
        end
        local _, _, _, mw = route(m[1])
        if mw then
            local mk = math.floor(tonumber(m[2]) * mw + 0.5)
            local x = mk * weight -- j/weight < mk/mw  <=>  j * mw < x
            local q = math.floor(x / mw)
            if q * mw > x then
                q = q - 1
            end
            local k = q + 1
            if q * mw == x and not before(device, m[1]) then
                k = q -- its turn q ties with the next one, and comes after it
            end
            return k / weight
        end
        redis.call('ZREM', ring, m[1]) -- no longer listed: never a candidate
    end
end

-- put a usable device where its live load says: the rings of its models (keeping its place
-- in each it is already in) or full (scored by its earliest idle deadline)
local function place(device, cap, weight, now_ms)
    sweep(device, now_ms)
    local load = LOAD_KEY .. device
    if redis.call('ZCARD', load) < cap then
        redis.call('ZREM', FULL, device)
        local expires, step = published(device)
        for _, ring in ipairs(rings(device)) do
            if not redis.call('ZSCORE', ring, device) then
                redis.call('ZADD', ring, join_score(ring, device, weight), device)
                redis.call('ZADD', hashring_of(ring), hash_of(device), device)
                if expires and expires > now_ms then -- its last score, until the next renewal
                    redis.call('ZADD', index_of(ring), step / weight, device)
                end
            end
        end
    else
        to_full(device, load)
    end
end

local function unenroll(device)
    for _, ring in ipairs(rings(device)) do
        leave_ring(ring, device)
    end
    redis.call('ZREM', FULL, device)
end

-- enroll the device if it may take episodes, else take it out of ring and full
local function enroll(device, now_ms)
    local node, state, cap, weight = route(device)
    if node and usable(node, state) then
        place(device, cap, weight, now_ms)
    else
        unenroll(device)
    end
end

-- an episode left the device's load set: a full device may take new ones again
local function freed(device, now_ms)
    if redis.call('ZSCORE', FULL, device) then
        enroll(device, now_ms)
    end
end

-- full devices whose earliest idle deadline has passed may have room again
local function refill(now_ms)
    for _, device in ipairs(redis.call('ZRANGEBYSCORE', FULL, '-inf', '(' .. int(now_ms))) do
        enroll(device, now_ms)
    end
end


-- the device ids of a node id in the devices index (every one, whatever its hash says)
local function indexed_devices(node)
    local out = {}
    local start = node .. '/'
    for _, id in ipairs(redis.call('SMEMBERS', DEVICES)) do
        if string.sub(id, 1, #start) == start then
            out[#out + 1] = id
        end
    end
    table.sort(out, before)
    return out
end

-- the devices a node registered (from its record; from the index if the record is gone)
local function node_devices(node)
    local listed = redis.call('HGET', NODE_KEY .. node, 'devices')
    if not listed then
        return indexed_devices(node)
    end
    local out = {}
    for device in string.gmatch(listed, '[^,]+') do
        out[#out + 1] = device
    end
    return out
end

-- Leases that ran out are noticed here, once: the node's devices leave ring, full and
-- route, its record stays (state down) for `affinity nodes`, one node-down event is written.
local function notice_lapses(now_ms)
    for _, node in ipairs(redis.call('ZRANGEBYSCORE', NODES, '-inf', int(now_ms))) do
        local deadline = redis.call('ZSCORE', NODES, node)
        for _, device in ipairs(node_devices(node)) do
            unenroll(device)
            redis.call('HDEL', ROUTE, device)
        end
        local key = NODE_KEY .. node
        if redis.call('EXISTS', key) == 1 then
            redis.call('HSET', key, 'state', 'down', 'lease', deadline)
        end
        redis.call('ZREM', NODES, node)
        redis.call('ZREM', LEASES, node)
        redis.call('ZREM', KNOWN, node)
        event('type', 'node-down', 'node', node, 'reason', 'lease lapsed', 'lease', deadline)
    end
end

-- Keep the ring's scores small so that k/w stays exact in a double: once the lowest passes
-- 2^20, every member moves back by the same whole number of turns (a shift of all scores
-- by an integer n moves each device back n*w picks; the order of turns is unchanged).
local function rebase(ring)
    local m = redis.call('ZRANGE', ring, 0, 0, 'WITHSCORES')
    if #m == 0 or tonumber(m[2]) < 1048576 then
        return
    end
    local shift = math.floor(tonumber(m[2]))
    local all = redis.call('ZRANGE', ring, 0, -1, 'WITHSCORES')
    for i = 1, #all, 2 do
        local _, _, _, w = route(all[i])
        if w then
            local k = math.floor(tonumber(all[i + 1]) * w + 0.5) - shift * w
            redis.call('ZADD', ring, k / w, all[i])
        else
            redis.call('ZREM', ring, all[i])
        end
    end
end

-- The lease a registration or renewal of `node` grants, and the longest lease TTL of the
-- fleet (ms). LEASES holds each leased node's own TTL, KNOWN the longest TTL each one has
-- heard of (`known`: what its last renewal answered). A node gets its own TTL, but never
-- more than every leased node has heard of: one whose lease is longer than the others knew
-- holds a shorter one until each of them renewed once more, so that a grace period started
-- after Redis lost its data (lib.lua's recovering, by any node) outlasts every lease held.
local function lease_terms(node, known)
    redis.call('ZADD', LEASES, LEASE, node)
    redis.call('ZADD', KNOWN, math.max(LEASE, tonumber(known) or 0), node)
    local longest = tonumber(redis.call('ZRANGE', LEASES, -1, -1, 'WITHSCORES')[2])
    local everyone = tonumber(redis.call('ZRANGE', KNOWN, 0, 0, 'WITHSCORES')[2])
    return math.min(LEASE, everyone), longest
end

-- the holder check shared by the node scripts: does another process hold this node id?
local function held_by_other(node, instance, now_ms)
    local holder = redis.call('HGET', NODE_KEY .. node, 'instance')
    return holder and holder ~= '' and instance ~= '' and holder ~= instance
        and alive(node, now_ms)
end


-- an episode handed over from a device (its value now ends in " moved"): listed in the
-- device's moved set until its idle deadline, so `affinity episodes` shows it as `show`
-- does; entries past their deadline are reaped here, a reassigned one is filtered on read
local function moved_from(device, episode, deadline, now_ms)
    local moved = MOVED_KEY .. device
    redis.call('ZREMRANGEBYSCORE', moved, '-inf', '(' .. int(now_ms))
    redis.call('ZADD', moved, deadline, episode)
end

-- hand an episode over from its device (handoff.lua, a revocation carried out in
-- renew.lua): its unmarked value `base` becomes "<base> moved" under `key` (same expiry),
-- its load slot is freed and it is listed in the device's moved set
local function hand_over(key, episode, device, base, now_ms)
    redis.call('SET', key, base .. ' moved', 'KEEPTTL')
    local deadline = redis.call('ZSCORE', LOAD_KEY .. device, episode)
    redis.call('ZREM', LOAD_KEY .. device, episode)
    if deadline then
        moved_from(device, episode, deadline, now_ms)
    end
    freed(device, now_ms)
end

-- an episode its owner holds, as register.lua and flush.lua receive it: five ARGV from i
-- (episode, device, token, claim id, model). Returns the episode, its device, its model,
-- the value it should have (lib.lua's value) and the value Redis holds (false: none).
local function held_at(i)
    local episode, device, model = ARGV[i], ARGV[i + 1], ARGV[i + 4]
    local want = value(device, ARGV[i + 2], ARGV[i + 3], model)
    return episode, device, model, want, redis.call('GET', EPISODE_KEY .. episode)
end

-- keep a held episode until `deadline` (ms): its value `kept` and its load-set member
local function slide(episode, device, kept, deadline)
    redis.call('SET', EPISODE_KEY .. episode, kept, 'PXAT', deadline)
    redis.call('ZADD', LOAD_KEY .. device, deadline, episode)
end

-- forget a device: record, index entry, route, ring/full, load and moved sets
local function remove_device(device)
    unenroll(device)
    redis.call('HDEL', ROUTE, device)
    redis.call('DEL', DEVICE_KEY .. device, LOAD_KEY .. device, MOVED_KEY .. device)
    redis.call('HDEL', SCORED, device)
    redis.call('SREM', DEVICES, device)
end
