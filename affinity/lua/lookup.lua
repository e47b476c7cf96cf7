-- lookup: read-only view of one episode's assignment (no TTL slide, no claim).
--
-- KEYS[1]  {ns}:episode:<episode>
-- KEYS[2]  {ns}:nodes
-- ARGV[1]  key prefix "{ns}:"; the device and node hashes are derived from the stored
--          device id (same hash tag, same slot).
--
-- Returns {} when the episode has no assignment, else
--   {device, token, ttl_ms, node, url, state, alive ("1"/"0")}

local prefix = ARGV[1]
local current = redis.call('GET', KEYS[1])
if not current then
    return {}
end
local device, token = string.match(current, '^(.+) (%d+)$')
local ttl = redis.call('PTTL', KEYS[1])
local d = redis.call('HMGET', prefix .. 'device:' .. device, 'node', 'state')
local node = d[1] or ''
local state = d[2] or 'removed'
local url = ''
local alive = '0'
if node ~= '' then
    local t = redis.call('TIME')
    local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local deadline = redis.call('ZSCORE', KEYS[2], node)
    url = redis.call('HGET', prefix .. 'node:' .. node, 'url') or ''
    if deadline and tonumber(deadline) > now_ms and url ~= '' then
        alive = '1'
    end
end
return {device, token, ttl, node, url, state, alive}
