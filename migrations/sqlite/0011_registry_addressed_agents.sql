-- Registry (aip-registry): agents reached at an address (embedded mode).
--
-- Same table as migrations/postgres/0011_registry_addressed_agents.sql, with SQLite types:
-- times are INTEGER milliseconds since the Unix epoch (UTC), JSON values are TEXT.

CREATE TABLE addressed_agents (
    agent_id       TEXT PRIMARY KEY NOT NULL,
    capabilities   TEXT NOT NULL,
    address        TEXT NOT NULL,
    status         TEXT NOT NULL CHECK (status IN ('available', 'busy', 'offline')),
    registered_by  TEXT NOT NULL,
    registered_at  INTEGER NOT NULL
) STRICT;
