-- How many times a task was handed to another agent (bounded by max_handoffs).
ALTER TABLE tasks ADD COLUMN handoffs integer NOT NULL DEFAULT 0;
