-- Registry (aip-registry): agents reached at an address, registered by a TaskRequest saying
-- "register me as an agent" (seed 004's agent management). They are not WebSocket clients:
-- no gateway, connection or liveness; one row per agent, never replaced.

CREATE TABLE addressed_agents (
    -- The agent's id; also refused while a WebSocket client (table agents) holds it.
    agent_id       text PRIMARY KEY,
    -- JSON array of strings (at least one).
    capabilities   jsonb NOT NULL,
    -- A URL or host:port, as given.
    address        text NOT NULL,
    status         text NOT NULL CHECK (status IN ('available', 'busy', 'offline')),
    -- `rest:<key name>` or `nats:<originating agent id>`.
    registered_by  text NOT NULL,
    registered_at  timestamptz NOT NULL
);

-- "find an agent": available agents by capabilities (containment).
CREATE INDEX addressed_agents_capabilities_idx ON addressed_agents USING gin (capabilities jsonb_path_ops) WHERE status = 'available';
