-- release: end one episode's assignment, token-checked.
--
-- KEYS[1]  {ns}:episode:<episode> (the episode id is KEYS[1] less EPISODE_KEY)
-- ARGV[1]  fencing token the caller holds (decimal string)
-- ARGV[2]  reason recorded in the event (end, operator, ...)
-- ARGV[3]  "owner" when the caller is the episode's owner (it dropped its record already)
--
-- The owner's release deletes the assignment and frees its load slot. Anyone else's (an
-- operator's) must not take the episode from an owner that serves it from memory: while
-- that owner's lease is live, the value is marked " revoked" (its load slot stays taken,
-- its steps still reach the owner) and the owner is told at its next renewal
-- ({ns}:revoked:<node>, renew.lua); once it dropped its record, its renewal turns the mark
-- into " moved" and the next resolve reassigns the episode (state_reset). Without a live
-- owner the assignment is deleted at once.
--
-- Returns {"released", device, token} | {"revoked", device, token} (the owner lets go at
-- its next renewal) | {"stale", device, current_token} | {"missing"}. A stale token or a
-- missing episode writes nothing. A full device whose slot this frees takes new episodes
-- again at once.

--@lib
--@fleet

local episode = string.sub(KEYS[1], #EPISODE_KEY + 1)
local current = redis.call('GET', KEYS[1])
if not current then
    return {'missing'}
end
local device, token, mark, _, _, base = parse(current)
if token ~= ARGV[1] then
    return {'stale', device, token}
end
local now_ms = clock()
if ARGV[3] ~= 'owner' and mark ~= 'moved' then
    local owner = redis.call('HGET', DEVICE_KEY .. device, 'node')
    local lease = owner and tonumber(redis.call('ZSCORE', NODES, owner) or '0')
    if owner and lease > now_ms then -- (a lapsed owner fenced itself: nobody to wait for)
        if mark == '' then
            redis.call('SET', KEYS[1], base .. ' revoked', 'KEEPTTL')
            event('type', 'revoke', 'episode', episode, 'device', device, 'token', token,
                'reason', ARGV[2])
        end
        -- kept until the owner's next renewal at least (which keeps it until answered),
        -- whatever lease TTL this caller was configured with
        redis.call('SADD', REVOKED_KEY .. owner, episode .. ' ' .. token)
        redis.call('PEXPIREAT', REVOKED_KEY .. owner, int(lease + 1000))
        return {'revoked', device, token}
    end
end
redis.call('DEL', KEYS[1])
if mark ~= 'moved' then
    redis.call('ZREM', LOAD_KEY .. device, episode)
    freed(device, now_ms)
end
event('type', 'release', 'episode', episode, 'device', device, 'token', token, 'reason', ARGV[2])
return {'released', device, token}
