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
-- Returns {previous_state, "1"} when written, {current_state, "0"} when ARGV[5] did not
-- match (nothing written), and {} when the device is unknown (nothing written).

local old = redis.call('HGET', KEYS[1], 'state')
if not old then
    return {}
end
if ARGV[5] ~= '' and old ~= ARGV[5] then
    return {old, '0'}
end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'reason', ARGV[3])
local kind = ({active = 'undrain', draining = 'drain', down = 'down'})[ARGV[2]]
if ARGV[2] == 'active' and old == 'down' then
    kind = 'up'
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*',
    'type', kind, 'device', ARGV[1], 'state', ARGV[2], 'from', old, 'reason', ARGV[3])
return {old, '1'}
