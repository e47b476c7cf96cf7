-- resolve: hit, claim or reassign the device of one episode, in one atomic step.
--
-- KEYS[1]  {ns}:episode:<episode>  "<device> <token> <claim id> <model>" (or "... moved",
--          or "... revoked": served by its owner as any other until it lets go),
--          PXAT backstop deadline; the episode id is KEYS[1] less EPISODE_KEY
-- ARGV[1]  "1": restart (always a fresh assignment, status "claimed"); "2": never claim
--          (an episode without an assignment answers "missing"); "" otherwise
-- ARGV[2]  the claim id a new assignment gets (random hex from the caller): it tells this
--          claim from any other that was given the same token number (a lossy failover)
-- ARGV[3]  the model's name the step names ("": a fleet whose nodes register no model,
--          whose devices are in the one RING; or an episode that keeps its own model)
-- ARGV[4]  the version the step names ("": the episode's own, else by rollout)
-- ARGV[5]  the longest lease TTL (ms) the caller has heard of (for a grace period it starts)
-- ARGV[6]  placement: "scored" (the lowest published step time, below) or anything else
--          (round-robin: the ring's stride, as always)
-- ARGV[7]  scored only: the most step time (ms) a chosen device may predict (the episode's
--          control period x the headroom); "" = no gate
-- Constants (TTL, the fleet's keys) come from the header (affinity/scripts.py, lib.lua).
--
-- Returns one string, "<status> <device> <token> <node> <url> <previous device> <claim id>
-- <instance> <model>" (instance: the process that holds the owner's registration, read
-- from its node hash NODE_KEY .. node, derived here: the same hash slot as every key;
-- model: "name@version" the episode is served with, "" in a fleet without models):
--   hit         the device is listed by its live node, not down, and its node still serves
--               the episode's model: deadline slid
--   claimed     no assignment existed (or a restart): a new one was written
--   reassigned  the device's node is dead, the device down or no longer listed, its node
--               no longer serves the episode's model, or the episode was handed over: a new
--               assignment with a fresh token, on a device that serves its (name, version);
--               also a claim within one backstop of a loss of Redis data (lib.lua): Redis
--               cannot tell a new episode from one it lost (previous is then empty)
--   missing     ARGV[1] "2" and no assignment exists: nothing was written
-- or "recovering <ms>": the fleet is in its grace period after Redis lost its data (lib.lua)
-- and this would be a claim, of any model (nothing was written but the marker); or
-- "full <reason>", reason "no_nodes" (no node holds a lease), "at_capacity" or "slo" (scored:
-- every qualifying device predicts more than ARGV[7]; an event "slo" is written): no
-- assignment was written (lapsed leases noticed, full devices re-checked may be);
-- "conflict <model>": the episode is served with <model> and the step names another name
-- or version (nothing written); "unknown": no node ever registered the model or version
-- the step names (nothing written).
--
-- A new episode's version: the one the step names; else by the operator's weights
-- (ROLLOUT_KEY .. name: version -> weight; stride scheduling over the versions of weight
-- > 0, PICKS_KEY .. name holding each one's picks/weight); without weights, the newest
-- registered version (VERSIONS_KEY .. name: version -> first registration, ms). Versions
-- are tried in that order: one whose devices are all full or gone passes to the next
-- (a version of weight 0 never takes a new episode). Its device: the ring of that
-- (name, version), as below. Neither the hit nor the claim reads more than one device per
-- version tried: the cost does not grow with the fleet. Tokens are decimal:
-- max(last + 1, server TIME in microseconds).
--
-- Scored placement (ARGV[6] "scored"): within the version, the device is the lowest of the
-- ring's score index (index_of, lib.lua: predicted step ms / weight) among its first PEEK
-- entries that is listed, active, has room, whose score has not expired and, with a gate,
-- predicts at most ARGV[7] ms (step = score x weight). Its score moves up by its cost /
-- weight, so a burst spreads. Entries found unlisted or expired are removed, full ones go
-- to full; when none of them qualified, nor was refused by the gate, the next PEEK are
-- read once more. A re-claim (reassigned) first tries the device its episode id hashes to
-- on the ring's hash ring when one more episode keeps its live load within LOAD_BOUND x
-- its share of the model's (live + 1) in the fleet view (VIEW: capacity-weighted average).
-- Only an empty index (no node has published yet) falls back to the ring's stride.

local key = KEYS[1]
local episode = string.sub(key, #EPISODE_KEY + 1)
local restart = ARGV[1] == '1'
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- the key and its load-set member expire at the same instant; integers go to commands as
-- decimal strings (a Lua number reaches Redis >= 7.2 as 1.796e+12 when it ends in zeros)
local deadline = string.format('%.0f', now_ms + TTL)

local current = redis.call('GET', key)
local device, token, flag, claim
local model = '' -- the episode's "name@version" while it has an assignment
if current then
    device, token, flag = string.match(current, VALUE)
    claim = string.match(flag, '^ (%x+)') or ''
    model = string.match(flag, '^ %x+ (%S+@%S+)') or ''
    if string.sub(flag, -6) ~= ' moved' then
        flag = ''
    end
elseif ARGV[1] == '2' then
    return 'missing'
end

-- a step naming another model or version than its episode's changes nothing (a restart
-- starts a new episode under the same id: it may name any)
if model ~= '' and not restart then
    local name, version = string.match(model, '^(.*)@(.*)$')
    if (ARGV[3] ~= '' and ARGV[3] ~= name) or (ARGV[4] ~= '' and ARGV[4] ~= version) then
        return 'conflict ' .. model
    end
end

local function instance(node)
    return redis.call('HGET', NODE_KEY .. node, 'instance') or ''
end

-- A hit: the device is in ROUTE (listed by a node whose lease nobody has seen lapse) and
-- not down. Returns nil when it is not a hit.
local function hit()
    local r = flag == '' and redis.call('HGET', ROUTE, device)
    if not r then
        return nil
    end
    local node, state, _, _, url = string.match(r, ROUTED)
    if state == 'down' then
        return nil
    end
    local held = redis.call('HMGET', NODE_KEY .. node, 'instance', 'models')
    if model ~= '' and not string.find(',' .. (held[2] or '') .. ',', ',' .. model .. ',', 1, true) then
        return nil -- its node registered again without the episode's model: reassign
    end
    redis.call('PEXPIREAT', key, deadline)
    redis.call('ZADD', LOAD_KEY .. device, deadline, episode)
    return 'hit ' .. device .. ' ' .. token .. ' ' .. node .. ' ' .. url .. '  ' .. claim .. ' '
        .. (held[1] or '') .. ' ' .. model
end

-- first without the shared functions (making them costs more than a hit); only when a
-- lease has run out unseen does the hit wait until that is noticed (below)
local unseen = redis.call('ZCOUNT', NODES, '-inf', now_ms) > 0
if current and not restart and not unseen then
    local reply = hit()
    if reply then
        return reply
    end
end

--@lib

-- The members of a device's load set: its live episodes, and idle ones past their deadline
-- until a sweep. Counting members is enough while they are fewer than the capacity; only
-- a set that reaches it is swept (and counted again), so it never holds more.
local function members(device, cap)
    local n = redis.call('ZCARD', LOAD_KEY .. device)
    if n >= cap then
        sweep(device, now_ms)
        n = redis.call('ZCARD', LOAD_KEY .. device)
    end
    return n
end

-- the ring's lowest member with its route and, when it is listed and active, the members
-- of its load set; nil when the ring is empty
local function lowest(ring)
    local m = redis.call('ZRANGE', ring, 0, 0, 'WITHSCORES')
    if #m == 0 then
        return nil
    end
    local node, state, cap, weight, url = route(m[1])
    local live
    if node and state == 'active' then
        live = members(m[1], cap)
    end
    return m[1], tonumber(m[2]), node, cap, weight, url, live
end

-- Scored placement: the index's first eligible device, as above. Returns chosen, index
-- score, node, cap, weight, url, live, cost; or nil and whether a device was refused by
-- the gate only.
local PEEK = 8
local LOAD_BOUND = 1.25
local scored = ARGV[6] == 'scored'
local limit = tonumber(ARGV[7] or '')

-- may device d (its index score given) take the claim? its route and live members, or nil
-- and why not: 'gone' (remove it from the index), 'full', 'slow' (the gate)
local function eligible(d, score)
    local node, state, cap, weight, url = route(d)
    local expires, _, cost = published(d)
    if not node or state ~= 'active' or not expires or expires <= now_ms then
        return nil, 'gone'
    end
    if limit and score * weight > limit then
        return nil, 'slow'
    end
    local live = members(d, cap)
    if live >= cap then
        to_full(d, LOAD_KEY .. d)
        return nil, 'full'
    end
    return {d, score, node, cap, weight, url, live, cost}
end

local function best(ring)
    local index = index_of(ring)
    local slow, kept = false, 0 -- kept: entries the gate refused, still ahead in the index
    -- the first entry alone (the common case: it qualifies), then up to PEEK - 1 more
    for pass = 1, 2 do
        local last = pass == 1 and kept or kept + PEEK - 2
        local top = redis.call('ZRANGE', index, kept, last, 'WITHSCORES')
        for i = 1, #top, 2 do
            local c, why = eligible(top[i], tonumber(top[i + 1]))
            if c then
                return c
            end
            if why == 'gone' then
                redis.call('ZREM', index, top[i])
            elseif why == 'slow' then
                slow, kept = true, kept + 1
            end -- ('full' left the index with the ring: to_full)
        end
        if #top == 0 then
            break
        end
    end
    return nil, slow
end

-- a re-claim's device on the hash ring, when it is eligible and its load within the bound
local function local_choice(ring, m)
    local hashring = hashring_of(ring)
    local h = hash_of(episode)
    local d = redis.call('ZRANGEBYSCORE', hashring, h, '+inf', 'LIMIT', 0, 1)[1]
        or redis.call('ZRANGE', hashring, 0, 0)[1]
    local view = d and m ~= '' and redis.call('GET', VIEW)
    local score = view and redis.call('ZSCORE', index_of(ring), d)
    if not score then
        return nil
    end
    local ok, doc = pcall(cjson.decode, view)
    local fleet = ok and type(doc) == 'table' and type(doc.models) == 'table' and doc.models[m]
    if type(fleet) ~= 'table' or not tonumber(fleet[2]) or tonumber(fleet[2]) <= 0 then
        return nil
    end
    -- bounded loads: one more episode keeps it within c x the fleet's average per slot
    local c = eligible(d, tonumber(score))
    if c and c[7] + 1 <= math.ceil(LOAD_BOUND * (tonumber(fleet[1]) + 1) * c[4] / tonumber(fleet[2])) then
        return c
    end
    return nil
end

-- The models a new assignment may take, in the order to try them: the episode's own when
-- it is reassigned, else the version named, else by the operator's weights (`stride` then
-- holds each one's {name, version, picks/weight, weight}), else newest first; {''} in a
-- fleet without models; nil when the name or version was never registered.
local stride = {}
local doubt = false -- Redis lost its data lately: a claim may be of an episode it lost
local function candidates()
    if model ~= '' and not restart then
        return {model}
    end
    local name, version = ARGV[3], ARGV[4]
    if name == '' then
        return {''}
    end
    if version ~= '' then
        if not redis.call('ZSCORE', VERSIONS_KEY .. name, version) then
            return nil
        end
        return {name .. '@' .. version}
    end
    local versions = redis.call('ZRANGE', VERSIONS_KEY .. name, 0, -1) -- oldest first
    if #versions == 0 then
        return nil
    end
    local weights = redis.call('HGETALL', ROLLOUT_KEY .. name)
    local out = {}
    if #weights == 0 then
        for i = #versions, 1, -1 do
            out[#out + 1] = name .. '@' .. versions[i]
        end
        return out
    end
    local scored = {}
    for i = 1, #weights, 2 do
        local w = tonumber(weights[i + 1])
        if w and w > 0 then
            local picks = tonumber(redis.call('ZSCORE', PICKS_KEY .. name, weights[i]) or '0')
            scored[#scored + 1] = {name, weights[i], picks, w}
        end
    end
    table.sort(scored, function(a, b)
        if a[3] ~= b[3] then
            return a[3] < b[3]
        end
        return before(a[2], b[2])
    end)
    for _, c in ipairs(scored) do
        local m = name .. '@' .. c[2]
        out[#out + 1] = m
        stride[m] = c
    end
    return out
end

local function ring_of(m)
    return m == '' and RING or RING_KEY .. m
end

-- write the new assignment of model m on the chosen device (its load set had `live`
-- members, fewer than `cap`, and it was scored k/weight in `ring`) and answer
local function assign(m, ring, chosen, score, node, cap, weight, url, live, previous, cost)
    -- the token is max(last + 1, TIME in microseconds): one command unless the clock is
    -- not ahead of the last token (several claims in one microsecond, or a clock behind)
    local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
    token = int(now_us)
    local last = tonumber(redis.call('SET', TOKEN, token, 'GET') or '0')
    if last >= now_us then
        token = int(last + 1)
        redis.call('SET', TOKEN, token)
    end
    redis.call('INCR', RR)
    redis.call('SET', key, chosen .. ' ' .. token .. ' ' .. ARGV[2] .. (m ~= '' and ' ' .. m or ''),
        'PXAT', deadline)
    local c = stride[m]
    if c then -- the version's turn among the weighted ones: picks/weight, as for devices
        redis.call('ZADD', PICKS_KEY .. c[1], (math.floor(c[3] * c[4] + 0.5) + 1) / c[4], c[2])
    end
    local load = LOAD_KEY .. chosen
    live = live + redis.call('ZADD', load, deadline, episode)
    if live >= cap then
        live = members(chosen, cap) -- swept: the idle ones may leave room
    end
    if live < cap then
        if cost then -- scored: the index moves (the ring's stride is round-robin's alone)
            redis.call('ZINCRBY', index_of(ring), cost / weight, chosen)
        else
            redis.call('ZADD', ring, (math.floor(score * weight + 0.5) + 1) / weight, chosen)
        end
    else
        to_full(chosen, load)
    end
    local status = 'claimed'
    if (previous ~= '' or doubt) and not restart then
        status = 'reassigned'
    end
    event('type', status == 'claimed' and 'claim' or 'reassign',
        'episode', episode, 'device', chosen, 'token', token, 'node', node, 'from', previous,
        'model', m)
    return status .. ' ' .. chosen .. ' ' .. token .. ' ' .. node .. ' ' .. url .. ' '
        .. (status == 'reassigned' and previous or '') .. ' ' .. ARGV[2] .. ' ' .. instance(node)
        .. ' ' .. m
end

-- No claim while the fleet recovers from a loss of Redis data (lib.lua): an owner may still
-- serve the episode from memory and has not re-asserted it yet. A hit (above, or once the
-- lapses are noticed below) is not held back.
local wait
if not (unseen and current and not restart) then
    wait, doubt = recovering(now_ms, ARGV[5])
    if wait then
        return 'recovering ' .. int(wait)
    end
end

-- The common claim, a new episode with nothing to tidy up first (no lease seen to lapse,
-- no full device due for a re-check), takes the ring's lowest member when it has room.
local models = candidates()
if not models then
    return 'unknown'
end
if not current and not unseen and redis.call('ZCOUNT', FULL, '-inf', '(' .. int(now_ms)) == 0 then
    local ring = ring_of(models[1])
    if scored then
        local c = best(ring)
        if c then
            return assign(models[1], ring, c[1], c[2], c[3], c[4], c[5], c[6], c[7], '', c[8])
        end
    else
        local chosen, score, node, cap, weight, url, live = lowest(ring)
        if live and live < cap then
            return assign(models[1], ring, chosen, score, node, cap, weight, url, live, '')
        end
    end
end

--@fleet

if unseen then
    notice_lapses(now_ms)
    if current and not restart then
        local reply = hit()
        if reply then
            return reply
        end
    end
end

if unseen and current and not restart then
    wait, doubt = recovering(now_ms, ARGV[5])
    if wait then
        return 'recovering ' .. int(wait)
    end
end

local previous = device or ''
local slot_freed = flag ~= nil and flag ~= '' -- handed over: its slot is free already
if restart and current and not slot_freed and redis.call('ZSCORE', FULL, previous) then
    -- a restart on a full device frees its slot first: it may take the same device
    redis.call('ZREM', LOAD_KEY .. previous, episode)
    freed(previous, now_ms)
    slot_freed = true
end

refill(now_ms)

local slow = false -- scored: a device was refused by the gate only
for _, m in ipairs(models) do
    local ring = ring_of(m)
    local c, gated
    local unscored = not scored -- round-robin, or no score published: the ring's stride
    if scored then
        if previous ~= '' then
            c = local_choice(ring, m)
        end
        if not c then
            c, gated = best(ring)
            if not c and not gated then -- the entries it met left the index: once more
                c, gated = best(ring)
            end
        end
        slow = slow or gated
        unscored = not c and not gated and redis.call('ZCARD', index_of(ring)) == 0
    end
    if c then
        if previous ~= '' and not slot_freed then
            if redis.call('ZREM', LOAD_KEY .. previous, episode) == 1 and previous == c[1] then
                c[7] = c[7] - 1
            end
            freed(previous, now_ms)
        end
        return assign(m, ring, c[1], c[2], c[3], c[4], c[5], c[6], c[7], previous, c[8])
    end
    while unscored do
        local chosen, score, node, cap, weight, url, live = lowest(ring)
        if not chosen then
            break -- this version has no device with room: the next one, if any
        end
        if live and live < cap then
            if previous ~= '' and not slot_freed then
                if redis.call('ZREM', LOAD_KEY .. previous, episode) == 1 and previous == chosen then
                    live = live - 1
                end
                freed(previous, now_ms)
            end
            return assign(m, ring, chosen, score, node, cap, weight, url, live, previous)
        end
        if live then
            place(chosen, cap, weight, now_ms) -- at capacity after all: to full
        else
            unenroll(chosen) -- not listed, or not active: never a candidate
            redis.call('ZREM', ring, chosen)
        end
    end
end
if slow then
    event('type', 'slo', 'episode', episode, 'limit_ms', ARGV[7], 'model', models[#models])
    return 'full slo'
end
return 'full ' .. (redis.call('ZCARD', NODES) == 0 and 'no_nodes' or 'at_capacity')
