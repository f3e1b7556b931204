-- Session service (aip-sessions): tasks, their event logs, processed frames and the outbox.
--
-- Times are epoch milliseconds (bigint) so the same code reads PostgreSQL and SQLite.

CREATE TABLE tasks (
    -- The task's id, which is also its AIP session_id (Galaxy's ids are kept as given).
    task_id             text PRIMARY KEY,
    task_name           text NOT NULL,
    state               text NOT NULL,
    request             text NOT NULL,
    data                TEXT,
    -- Who asked: 'client' (a WebSocket client), 'rest' or 'nats'; and its id.
    requester_kind      text NOT NULL,
    requester_id        text NOT NULL,
    -- For a client requester: device or constellation.
    requester_type      text,
    executor_id         text,
    executor_platform   text,
    -- JSON array of strings.
    required_capabilities TEXT NOT NULL DEFAULT '[]',
    -- 'scripted' (steps carried by the task) or 'remote' (planner.next).
    planner             text NOT NULL,
    -- Scripted steps: JSON array of arrays of Commands.
    steps               TEXT,
    -- Index of the next step to plan.
    step                integer NOT NULL DEFAULT 0,
    -- response_id of the command frame in flight, if any.
    pending_response_id text,
    -- A step has been answered (or the task dispatched) and the next step is to be planned.
    needs_plan          INTEGER NOT NULL DEFAULT 0,
    -- Started by UFO's POST /api/dispatch: dispatching sends a server `task` frame.
    ufo_dispatch        INTEGER NOT NULL DEFAULT 0,
    -- A UFO dispatch waits for the device to echo the task.
    awaiting_echo       INTEGER NOT NULL DEFAULT 0,
    -- Every step's commands and results: JSON array.
    history             TEXT NOT NULL DEFAULT '[]',
    priority            integer NOT NULL DEFAULT 0,
    result              TEXT,
    error               text,
    error_code          text,
    callback_url        text,
    -- The task fails with TASK_TIMEOUT at task_deadline_ms; deadline_ms is the nearer of that
    -- and the pending command's deadline.
    task_deadline_ms    bigint NOT NULL,
    deadline_ms         bigint NOT NULL,
    created_ms          bigint NOT NULL,
    updated_ms          bigint NOT NULL,
    -- Sequence number the next event gets: gap-free per task.
    next_seq            bigint NOT NULL DEFAULT 1
);

CREATE INDEX tasks_name_idx ON tasks (task_name, created_ms DESC);
CREATE INDEX tasks_created_idx ON tasks (created_ms DESC, task_id DESC);
CREATE INDEX tasks_executor_live_idx ON tasks (executor_id, state)
    WHERE state IN ('submitted', 'dispatched', 'working', 'input_required');
CREATE INDEX tasks_requester_live_idx ON tasks (requester_id)
    WHERE state IN ('submitted', 'dispatched', 'working', 'input_required');
CREATE INDEX tasks_deadline_idx ON tasks (deadline_ms)
    WHERE state IN ('submitted', 'dispatched', 'working', 'input_required');
CREATE INDEX tasks_needs_plan_idx ON tasks (updated_ms) WHERE needs_plan = 1;

CREATE TABLE task_events (
    task_id  text NOT NULL REFERENCES tasks (task_id) ON DELETE CASCADE,
    seq      bigint NOT NULL,
    at_ms    bigint NOT NULL,
    kind     text NOT NULL,
    state    text NOT NULL,
    data     TEXT,
    PRIMARY KEY (task_id, seq)
);

-- Frames already applied (by Nats-Msg-Id), so a redelivered frame changes nothing twice.
CREATE TABLE processed_messages (
    msg_id  text PRIMARY KEY,
    at_ms   bigint NOT NULL
);

-- Frames to deliver, written in the same transaction as the state change that sends them;
-- published right after commit and removed; a sweeper re-publishes rows a crash left behind.
CREATE TABLE outbox (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    subject     text NOT NULL,
    payload     BLOB NOT NULL,
    created_ms  bigint NOT NULL
);
