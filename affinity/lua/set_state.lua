-- set_state: change a device's state (active, draining, down) with a reason.
--
-- KEYS[1]  {ns}:device:<device> (the device id is KEYS[1] less DEVICE_KEY)
-- ARGV[1]  new state: active | draining | down
-- ARGV[2]  reason (free text, may be empty)
-- ARGV[3]  only-if state: when not empty, change only if the current state equals it
--          (the crash tracker brings back only a device it marked down itself)
--
-- Going down remembers the state before (prev_state, prev_reason); leaving down for
-- "active" restores a remembered operator's drain instead. Draining a device that is down
-- keeps it down (its episodes must still move) and remembers the drain for when it is up.
-- The route follows the state, and the device enters or leaves the ring at once.
-- Returns {previous_state, "1", state_now} when written, {current_state, "0",
-- current_state} when ARGV[3] did not match or the device already has that state and
-- reason (nothing written, no event: a repeated drain is a no-op), and {} when the device
-- is unknown (nothing written).

--@lib
--@fleet

local device = string.sub(KEYS[1], #DEVICE_KEY + 1)
local cur = redis.call('HMGET', KEYS[1], 'state', 'reason', 'prev_state', 'prev_reason')
local old = cur[1]
if not old then
    return {}
end
if ARGV[3] ~= '' and old ~= ARGV[3] then
    return {old, '0', old}
end
if ARGV[1] == old and ARGV[2] == (cur[2] or '') then
    return {old, '0', old}
end
local want, state, reason = ARGV[1], ARGV[1], ARGV[2]
local kind = ({active = 'undrain', draining = 'drain', down = 'down'})[want]
if want == 'down' and old ~= 'down' then
    redis.call('HSET', KEYS[1], 'prev_state', old, 'prev_reason', cur[2] or '')
elseif old == 'down' and want == 'draining' then
    redis.call('HSET', KEYS[1], 'prev_state', 'draining', 'prev_reason', reason)
    state, reason = 'down', cur[2] or ''
elseif old == 'down' and want == 'active' then
    kind = 'up'
    if cur[3] == 'draining' then
        state, reason = 'draining', cur[4] or ''
    end
    redis.call('HDEL', KEYS[1], 'prev_state', 'prev_reason')
end
redis.call('HSET', KEYS[1], 'state', state, 'reason', reason)
local node, _, cap, weight, url = route(device)
if node then
    set_route(device, node, state, cap, weight, url)
end
enroll(device, clock())
event('type', kind, 'device', device, 'state', state, 'from', old, 'reason', reason)
return {old, '1', state}
