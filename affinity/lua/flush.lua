-- flush: what an owner tells Redis about the episodes it serves from memory, once a second
-- at most, in one round trip (node/flusher.py).
--
-- KEYS[1]  {ns}:node:<node> (the node id is KEYS[1] less NODE_KEY)
-- ARGV[1]  instance id of the owner process
-- ARGV[2]  the longest lease TTL (ms) the owner has heard of (for a grace period it starts)
-- ARGV[3]  n, the number of episodes to slide
-- ARGV[4..] 5 fields per episode to slide (n times): episode, device, token, claim id, model
--          ("name@version", "" = none); then 2 fields per episode the owner ended for being
--          idle: episode, token
--
-- Slides: an assignment Redis holds with the same value (model included; an operator's
-- " revoked" mark is kept, the renewal carries it out) gets the backstop expiry again, and
-- so does its load-set member; one Redis gives to another claim, or has lost outside a
-- grace period (an operator released it), is answered as lost: the owner drops it. During
-- a grace period (lib.lua) a lost one is written again, as a re-registration does.
-- Releases: token-checked, as release.lua; the load slot is freed (a full device takes new
-- episodes again, on the rings of all its models); a "release" event (reason "idle") says
-- which.
-- Returns {grace ms left (0: none), lost episode...}; {-1} (nothing written) when this
-- instance holds no current lease on the node id: it renews or registers first.

--@lib
--@fleet

local node = string.sub(KEYS[1], #NODE_KEY + 1)
local now_ms = clock()
if redis.call('HGET', KEYS[1], 'instance') ~= ARGV[1] or not alive(node, now_ms) then
    return {-1}
end
local grace = recovering(now_ms, ARGV[2])
local deadline = int(now_ms + TTL)
local last = 3 + 5 * tonumber(ARGV[3])
local lost = {}
for i = 4, last, 5 do
    local episode, device, _, want, current = held_at(i)
    if current == want or current == want .. ' revoked' or (not current and grace) then
        slide(episode, device, current or want, deadline)
    else
        lost[#lost + 1] = episode
    end
end
for i = last + 1, #ARGV, 2 do
    local episode, token = ARGV[i], ARGV[i + 1]
    local key = EPISODE_KEY .. episode
    local current = redis.call('GET', key)
    if current then
        local device, held, mark = parse(current)
        if held == token and mark ~= 'moved' then
            redis.call('DEL', key)
            redis.call('ZREM', LOAD_KEY .. device, episode)
            freed(device, now_ms)
            event('type', 'release', 'episode', episode, 'device', device, 'token', token,
                'reason', 'idle')
        end
    end
end
return {int(grace or 0), unpack(lost)}
