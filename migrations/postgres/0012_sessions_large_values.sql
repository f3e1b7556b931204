-- Large values (a screenshot in a command's results: tens of MiB) are stored as they come.
--
-- `json`, not `jsonb`: the session service writes and reads these columns whole and never
-- queries inside them, and PostgreSQL checks `json` input without building a tree, which
-- `jsonb` does for every value (about 0.4 s more for a 90 MiB value here).
--
-- `STORAGE EXTERNAL`: out of line when large, never compressed. With the default (EXTENDED)
-- PostgreSQL tries to compress every large value first; base64 screenshots do not compress,
-- and the attempt cost about 2 s for each 90 MiB copy (the task's history, its result, the
-- results and ended events, the task_end frames in the outbox) before it was given up.
ALTER TABLE tasks
    ALTER COLUMN data TYPE json USING data::json,
    ALTER COLUMN required_capabilities DROP DEFAULT,
    ALTER COLUMN required_capabilities TYPE json USING required_capabilities::json,
    ALTER COLUMN required_capabilities SET DEFAULT '[]'::json,
    ALTER COLUMN steps TYPE json USING steps::json,
    ALTER COLUMN history DROP DEFAULT,
    ALTER COLUMN history TYPE json USING history::json,
    ALTER COLUMN history SET DEFAULT '[]'::json,
    ALTER COLUMN result TYPE json USING result::json,
    ALTER COLUMN question TYPE json USING question::json,
    ALTER COLUMN requester_extensions TYPE json USING requester_extensions::json,
    ALTER COLUMN callback_on TYPE json USING callback_on::json;

ALTER TABLE tasks
    ALTER COLUMN request SET STORAGE EXTERNAL,
    ALTER COLUMN data SET STORAGE EXTERNAL,
    ALTER COLUMN steps SET STORAGE EXTERNAL,
    ALTER COLUMN history SET STORAGE EXTERNAL,
    ALTER COLUMN result SET STORAGE EXTERNAL,
    ALTER COLUMN question SET STORAGE EXTERNAL;

ALTER TABLE task_events
    ALTER COLUMN data TYPE json USING data::json,
    ALTER COLUMN data SET STORAGE EXTERNAL;

ALTER TABLE task_outbox ALTER COLUMN payload SET STORAGE EXTERNAL;
ALTER TABLE task_callbacks ALTER COLUMN payload SET STORAGE EXTERNAL;

-- A scripted task's result is its history (every step's commands and results): the row keeps
-- it once, with `result` NULL.
ALTER TABLE tasks ADD COLUMN result_is_history boolean NOT NULL DEFAULT false;

-- What an outbox row's payload holds: the frame ('frame'), or for a large task_end the task
-- and response id it is built from again if it must be re-sent ('task_end_of'): the result is
-- in the task's row already.
ALTER TABLE task_outbox ADD COLUMN payload_kind text NOT NULL DEFAULT 'frame';
