-- A task waiting in input_required keeps its open question (who asked, the text, the
-- deadline); NULL otherwise. A client requester keeps the extensions it announced, so that
-- extension frames (clarification requests) reach only a client that understands them.
ALTER TABLE tasks ADD COLUMN question jsonb;
ALTER TABLE tasks ADD COLUMN requester_extensions jsonb;
