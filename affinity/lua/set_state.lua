-- set_state: change a device's state (active, draining, down) with a reason.
--
-- KEYS[1]  {ns}:device:<device>
-- KEYS[2]  {ns}:events
-- ARGV[1]  device id
-- ARGV[2]  new state: active | draining | down
-- ARGV[3]  reason (free text, may be empty)
-- ARGV[4]  approximate MAXLEN of the events stream
-- ARGV[5]  only-if state: when not empty, change only if the current state equals it
--          (the crash tracker brings back only a device it marked down itself)
--
-- Going down remembers the state before (prev_state, prev_reason); leaving down for
-- "active" restores a remembered operator's drain instead.
-- Returns {previous_state, "1"} when written, {current_state, "0"} when ARGV[5] did not
-- match (nothing written), and {} when the device is unknown (nothing written).

local cur = redis.call('HMGET', KEYS[1], 'state', 'reason', 'prev_state', 'prev_reason')
local old = cur[1]
if not old then
    return {}
end
if ARGV[5] ~= '' and old ~= ARGV[5] then
    return {old, '0'}
end
local state, reason = ARGV[2], ARGV[3]
if state == 'down' and old ~= 'down' then
    -- remember what the device was, so that coming back up restores an operator's drain
    redis.call('HSET', KEYS[1], 'prev_state', old, 'prev_reason', cur[2] or '')
elseif old == 'down' and state ~= 'down' then
    if state == 'active' and cur[3] == 'draining' then
        state, reason = 'draining', cur[4] or ''
    end
    redis.call('HDEL', KEYS[1], 'prev_state', 'prev_reason')
end
redis.call('HSET', KEYS[1], 'state', state, 'reason', reason)
local kind = ({active = 'undrain', draining = 'drain', down = 'down'})[state]
if old == 'down' and state ~= 'down' then
    kind = 'up'
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*',
    'type', kind, 'device', ARGV[1], 'state', state, 'from', old, 'reason', reason)
return {old, '1'}
