-- A scripted task's result is its history: the row keeps it once (`result` NULL).
ALTER TABLE tasks ADD COLUMN result_is_history INTEGER NOT NULL DEFAULT 0;
