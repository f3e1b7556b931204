-- Callbacks: a task's CallbackNotification for each state its requester is told of over
-- HTTP, written in the same group commit as the state change, and delivered (signed, retried)
-- by the leading replica until the receiver accepts it, answers 410, or the attempts run out.
CREATE TABLE task_callbacks (
    -- The Standard Webhooks `webhook-id`: `<task_id>:<event seq>`, the same on every attempt.
    callback_id      text PRIMARY KEY,
    task_id          text NOT NULL,
    -- The URL it goes to.
    target           text NOT NULL,
    -- The CallbackNotification, sent (and signed) byte for byte as stored.
    payload          text NOT NULL,
    -- 'pending', 'delivered', 'gone' (the receiver answered 410) or 'dead' (attempts ran out).
    state            text NOT NULL,
    -- Attempts made, ever (attempt numbers in callback_attempts).
    attempts         integer NOT NULL DEFAULT 0,
    -- `attempts` when it was last (re)queued: the budget counts from here.
    attempts_base    integer NOT NULL DEFAULT 0,
    -- When a pending callback is due (a replica delivering it pushes this forward as a claim).
    next_attempt_ms  bigint NOT NULL,
    created_ms       bigint NOT NULL,
    updated_ms       bigint NOT NULL,
    last_status      integer,
    last_error       text
);
CREATE INDEX task_callbacks_due ON task_callbacks (next_attempt_ms) WHERE state = 'pending';
CREATE INDEX task_callbacks_task ON task_callbacks (task_id);

-- Every delivery attempt, for the delivery log over REST.
CREATE TABLE callback_attempts (
    callback_id  text NOT NULL,
    attempt      integer NOT NULL,
    at_ms        bigint NOT NULL,
    duration_ms  bigint NOT NULL,
    -- The receiver's HTTP status, if it answered.
    status       integer,
    -- Why the attempt did not deliver (a connection error, a status, a refused address).
    error        text,
    PRIMARY KEY (callback_id, attempt)
);
