-- restore_rollout: a node puts back what it last read of a model's rollout, after Redis
-- lost its data (the node registered into an empty Redis: a grace period had begun).
--
-- KEYS[1]  {ns}:rollout:<name>  hash version -> weight (the model name is KEYS[1] less
--          ROLLOUT_KEY; VERSIONS_KEY .. name and PICKS_KEY .. name share the hash tag)
-- ARGV[1]  n, the number of versions the node remembers
-- ARGV[2..2n+1]  version, its first registration (ms) as Redis had it, n times
-- ARGV[2n+2..]   version, weight: the operator's weights the node last read (none: the
--                model had no rollout)
--
-- No command removes a version or moves its first registration later, so a remembered
-- version that Redis lacks, or holds with a later time, means Redis lost its data. Then
-- (and only then) the remembered times are written back (ZADD LT: a version re-registered
-- after the loss gets its old place back, so the newest is the newest it was), and the
-- weights too while the model has none at all (an operator's rollout made since wins; one
-- cleared with Redis intact is never put back); its stride picks start again. One event
-- "rollout-restore" says what was put back. Returns {versions whose time was put back,
-- 1 when the weights were, else 0}.

--@lib
--@fleet

local name = string.sub(KEYS[1], #ROLLOUT_KEY + 1)
local n = tonumber(ARGV[1])
local moved, order = 0, {}
for i = 2, 2 * n, 2 do
    moved = moved + redis.call('ZADD', VERSIONS_KEY .. name, 'LT', 'CH', ARGV[i + 1], ARGV[i])
    order[#order + 1] = ARGV[i] .. ':' .. ARGV[i + 1]
end
local weighted, weights = 0, {}
if moved > 0 and #ARGV > 2 * n + 1 and redis.call('EXISTS', KEYS[1]) == 0 then
    for i = 2 * n + 2, #ARGV, 2 do
        redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
        weights[#weights + 1] = ARGV[i] .. '=' .. ARGV[i + 1]
    end
    redis.call('DEL', PICKS_KEY .. name)
    weighted = 1
end
if moved > 0 or weighted == 1 then
    event('type', 'rollout-restore', 'model', name, 'versions', table.concat(order, ','),
        'weights', table.concat(weights, ','))
end
return {moved, weighted}
