-- release: compare-and-delete one episode's assignment and free its load slot.
--
-- KEYS[1]  {ns}:episode:<episode> (the episode id is KEYS[1] less EPISODE_KEY)
-- ARGV[1]  fencing token the caller holds (decimal string)
-- ARGV[2]  reason recorded in the event (end, operator, ...)
-- ARGV[3]  "owner" when the caller is the episode's owner (it dropped its record already);
--          otherwise the owner, if its lease is live, is told at its next renewal
--          ({ns}:revoked:<node>, renew.lua), since it serves the episode from memory
--
-- Returns {"released", device, token} | {"stale", device, current_token} | {"missing"}.
-- A stale token or a missing episode writes nothing. A full device whose slot this frees
-- takes new episodes again at once.

--@lib
--@fleet

local episode = string.sub(KEYS[1], #EPISODE_KEY + 1)
local current = redis.call('GET', KEYS[1])
if not current then
    return {'missing'}
end
local device, token, moved = parse(current)
if token ~= ARGV[1] then
    return {'stale', device, token}
end
redis.call('DEL', KEYS[1])
if not moved then
    redis.call('ZREM', LOAD_KEY .. device, episode)
    freed(device, clock())
    local owner = ARGV[3] ~= 'owner' and redis.call('HGET', DEVICE_KEY .. device, 'node')
    local lease = owner and tonumber(redis.call('ZSCORE', NODES, owner) or '0')
    if owner and lease > clock() then -- (a lapsed owner fenced itself: nothing to tell)
        -- kept until the owner's next renewal at least (which keeps it until answered),
        -- whatever lease TTL this caller was configured with
        redis.call('SADD', REVOKED_KEY .. owner, episode .. ' ' .. token)
        redis.call('PEXPIREAT', REVOKED_KEY .. owner, int(lease + 1000))
    end
end
event('type', 'release', 'episode', episode, 'device', device, 'token', token, 'reason', ARGV[2])
return {'released', device, token}
