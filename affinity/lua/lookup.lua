-- lookup: read-only view of one episode's assignment (no TTL slide, no claim).
--
-- KEYS[1]  {ns}:episode:<episode>
--
-- Returns {} when the episode has no assignment, else
--   {device, token, ttl_ms, node, url, state, alive ("1"/"0"), mark ("", "revoked" or
--    "moved", lib.lua), claim id, model ("name@version", "" when its node registered none)}
-- alive: the device is listed by its node and that node's lease is current.

--@lib
--@fleet

local current = redis.call('GET', KEYS[1])
if not current then
    return {}
end
local device, token, mark, claim, model = parse(current)
local ttl = redis.call('PTTL', KEYS[1])
local d = redis.call('HMGET', DEVICE_KEY .. device, 'node', 'state')
local node = d[1] or ''
local state = d[2] or 'removed'
local url = ''
if node ~= '' then
    url = redis.call('HGET', NODE_KEY .. node, 'url') or ''
end
local listed_by = route(device)
local live = listed_by ~= nil and alive(listed_by, clock())
return {device, token, ttl, node, url, state, live and '1' or '0', mark, claim, model}
