-- The states besides the end (always) a task's callback is sent for, as the request asked:
-- a JSON list of states; NULL for none.
ALTER TABLE tasks ADD COLUMN callback_on jsonb;
