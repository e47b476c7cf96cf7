-- handoff: hand one episode over (graceful stop): its next resolve is "reassigned".
--
-- KEYS[1]  {ns}:episode:<episode> (the episode id is KEYS[1] less EPISODE_KEY)
-- ARGV[1]  fencing token the caller holds (decimal string)
--
-- While the token still holds the episode, its value becomes "<device> <token> moved"
-- (same expiry; redis-cli GET still shows where it was), its load slot is freed (the
-- episode moves to the device's moved set, for listing), and a handoff event is written.
-- Returns 1, or 0 (nothing written) when another token holds the episode, it was already
-- handed over, or it has no assignment.

--@lib
--@fleet

local episode = string.sub(KEYS[1], #EPISODE_KEY + 1)
local current = redis.call('GET', KEYS[1])
if not current then
    return 0
end
local device, token, mark, _, _, base = parse(current)
if mark == 'moved' or token ~= ARGV[1] then
    return 0
end
hand_over(KEYS[1], episode, device, base, clock())
event('type', 'handoff', 'episode', episode, 'device', device, 'token', token)
return 1
