-- resolve: hit, claim or reassign the device of one episode, in one atomic step.
--
-- KEYS[1]  {ns}:episode:<episode>   string "<device> <token>", PX = idle TTL
-- KEYS[2]  {ns}:rr                  round-robin counter, INCRed once per new claim
-- KEYS[3]  {ns}:token               last fencing token handed out
-- KEYS[4]  {ns}:nodes               zset node -> lease deadline (ms, server time)
-- KEYS[5]  {ns}:events              capped stream
-- ARGV[1]  episode id
-- ARGV[2]  idle TTL in milliseconds
-- ARGV[3]  key prefix "{ns}:". Device, node and load keys are derived from stored data
--          (the device named in an assignment, the devices a node lists): they share the
--          namespace hash tag, hence the slot of KEYS[*], so this is safe on Redis Cluster.
-- ARGV[4]  approximate MAXLEN of the events stream
--
-- Returns {status, device, token, node, url, previous_device}; status is one of
--   "hit"        the stored device is alive and not down: TTL and load deadline slid
--   "claimed"    no assignment existed: a new one was written
--   "reassigned" the stored device's node lease is gone or the device is down/removed:
--                a new assignment with a fresh token was written
--   "full"       no device is eligible: nothing at all was written
-- Tokens are strings of decimal digits: max(last + 1, server TIME in microseconds).

local prefix = ARGV[3]
local ttl = tonumber(ARGV[2])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])

local function live_node_url(node)
    local deadline = redis.call('ZSCORE', KEYS[4], node)
    if not deadline or tonumber(deadline) <= now_ms then
        return false
    end
    return redis.call('HGET', prefix .. 'node:' .. node, 'url')
end

local previous = ''
local current = redis.call('GET', KEYS[1])
if current then
    local device, token = string.match(current, '^(.+) (%d+)$')
    local d = redis.call('HMGET', prefix .. 'device:' .. device, 'node', 'state')
    if d[1] and d[2] ~= 'down' then
        local url = live_node_url(d[1])
        if url then
            redis.call('PEXPIRE', KEYS[1], ttl)
            redis.call('ZADD', prefix .. 'load:' .. device, now_ms + ttl, ARGV[1])
            return {'hit', device, token, d[1], url, ''}
        end
    end
    previous = device
end

-- Eligible devices: node alive, device listed by that node, state active, live load < capacity.
local candidates = {}
local total = 0
local alive = redis.call('ZRANGEBYSCORE', KEYS[4], '(' .. now_ms, '+inf')
for _, node in ipairs(alive) do
    local n = redis.call('HMGET', prefix .. 'node:' .. node, 'devices', 'url')
    if n[1] then
        for device in string.gmatch(n[1], '[^,]+') do
            local d = redis.call('HMGET', prefix .. 'device:' .. device, 'node', 'state', 'capacity', 'weight')
            if d[1] == node and d[2] == 'active' then
                -- live while deadline >= now: Redis keeps a key until now > its expiry
                local load = redis.call('ZCOUNT', prefix .. 'load:' .. device, now_ms, '+inf')
                if load < tonumber(d[3]) then
                    local weight = tonumber(d[4])
                    total = total + weight
                    candidates[#candidates + 1] = {device, weight, node, n[2]}
                end
            end
        end
    end
end
if #candidates == 0 then
    return {'full', previous, '', '', '', previous}
end
table.sort(candidates, function(a, b) return a[1] < b[1] end)

-- Weighted round-robin: slot (n - 1) mod total walks the cumulative weights, so over any
-- window of `total` consecutive claims each device gets exactly its weight.
local slot = (redis.call('INCR', KEYS[2]) - 1) % total
local pick = candidates[#candidates]
for _, c in ipairs(candidates) do
    if slot < c[2] then
        pick = c
        break
    end
    slot = slot - c[2]
end
local device, node, url = pick[1], pick[3], pick[4]

local last = tonumber(redis.call('GET', KEYS[3]) or '0')
local token = string.format('%.0f', math.max(last + 1, now_us))
redis.call('SET', KEYS[3], token)

local status = 'claimed'
if previous ~= '' then
    status = 'reassigned'
    redis.call('ZREM', prefix .. 'load:' .. previous, ARGV[1])
    redis.call('SET', KEYS[1], device .. ' ' .. token, 'PX', ttl)
else
    redis.call('SET', KEYS[1], device .. ' ' .. token, 'PX', ttl, 'NX')
end

local load_key = prefix .. 'load:' .. device
local expired = redis.call('ZREMRANGEBYSCORE', load_key, '-inf', '(' .. now_ms)
redis.call('ZADD', load_key, now_ms + ttl, ARGV[1])
if expired > 0 then
    redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[4], '*',
        'type', 'expire', 'device', device, 'count', expired)
end
redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[4], '*',
    'type', status == 'claimed' and 'claim' or 'reassign',
    'episode', ARGV[1], 'device', device, 'token', token, 'node', node, 'from', previous)
return {status, device, token, node, url, previous}
