-- Registry (aip-registry): agents and the gateways holding their connections.
--
-- Times come from the database clock (now()), so every registry replica judges liveness by
-- one clock. JSON values are jsonb.

CREATE TABLE agents (
    -- The client's id, exactly as it sent it.
    agent_id        text PRIMARY KEY,
    client_type     text NOT NULL CHECK (client_type IN ('device', 'constellation')),
    platform        text NOT NULL CHECK (platform IN ('windows', 'linux', 'mobile')),
    status          text NOT NULL CHECK (status IN ('available', 'busy', 'offline')),
    -- Why an offline agent is offline. Only 'liveness_expired' may be revived by a later
    -- presence report of the same connection (e.g. after a registry outage).
    offline_reason  text CHECK (offline_reason IN ('unregistered', 'gateway_stopped', 'liveness_expired')),
    -- JSON array of strings.
    capabilities    jsonb NOT NULL DEFAULT '[]'::jsonb,
    -- JSON array of MCPToolInfo objects.
    tools           jsonb NOT NULL DEFAULT '[]'::jsonb,
    -- REGISTER metadata.system_info, verbatim.
    system_info     jsonb,
    -- REGISTER metadata, verbatim.
    metadata        jsonb,
    -- JSON array of negotiated extension names.
    extensions      jsonb NOT NULL DEFAULT '[]'::jsonb,
    -- For a constellation: the device named in REGISTER target_id.
    target_id       text,
    -- The credential that authenticated the connection; only it may take over a live entry.
    principal       text NOT NULL,
    -- The gateway and connection holding (or, when offline, last holding) the agent.
    gateway_id      text NOT NULL,
    connection_id   text NOT NULL,
    -- Tasks running on the agent now (maintained by the session service).
    load            integer NOT NULL DEFAULT 0,
    connected_at    timestamptz NOT NULL,
    last_seen       timestamptz NOT NULL
);

-- Lookup: available agents of a type, least loaded first, then most recently seen.
CREATE INDEX agents_lookup_idx ON agents (client_type, load, last_seen DESC) WHERE status = 'available';
-- Lookup by capabilities (containment, `capabilities @> '["a","b"]'`).
CREATE INDEX agents_capabilities_idx ON agents USING gin (capabilities jsonb_path_ops) WHERE status = 'available';
-- Reaper and gateway shutdown: live agents by gateway and by last sign of life.
CREATE INDEX agents_live_gateway_idx ON agents (gateway_id) WHERE status <> 'offline';
CREATE INDEX agents_live_last_seen_idx ON agents (last_seen) WHERE status <> 'offline';

-- Gateways, as known from their presence batches and registrations. A gateway silent past the
-- liveness window is taken as dead, and so are the agents it held.
CREATE TABLE gateways (
    gateway_id   text PRIMARY KEY,
    last_seen    timestamptz NOT NULL,
    -- The gateway's announced reporting interval (0 until its first presence batch).
    interval_ms  bigint NOT NULL DEFAULT 0
);
