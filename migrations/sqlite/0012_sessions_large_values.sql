-- A scripted task's result is its history: the row keeps it once (`result` NULL).
ALTER TABLE tasks ADD COLUMN result_is_history INTEGER NOT NULL DEFAULT 0;

-- What an outbox row's payload holds: the frame ('frame'), or for a large task_end the task
-- and response id it is built from again if it must be re-sent ('task_end_of').
ALTER TABLE task_outbox ADD COLUMN payload_kind TEXT NOT NULL DEFAULT 'frame';
