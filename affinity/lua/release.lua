-- release: compare-and-delete one episode's assignment and free its load slot.
--
-- KEYS[1]  {ns}:episode:<episode>
-- KEYS[2]  {ns}:events
-- ARGV[1]  episode id
-- ARGV[2]  fencing token the caller holds (decimal string)
-- ARGV[3]  key prefix "{ns}:"; the load set is derived from the stored device id
--          (same hash tag, same slot).
-- ARGV[4]  approximate MAXLEN of the events stream
-- ARGV[5]  reason recorded in the event (end, operator, ...)
--
-- Returns {"released", device, token} | {"stale", device, current_token} | {"missing"}.
-- A stale token or a missing episode writes nothing.

local current = redis.call('GET', KEYS[1])
if not current then
    return {'missing'}
end
local device, token = string.match(current, '^(.+) (%d+)$')
if token ~= ARGV[2] then
    return {'stale', device, token}
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', ARGV[3] .. 'load:' .. device, ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*',
    'type', 'release', 'episode', ARGV[1], 'device', device, 'token', token, 'reason', ARGV[5])
return {'released', device, token}
