-- Registry (aip-registry): agents and the gateways holding their connections (embedded mode).
--
-- Same tables as migrations/postgres/0001_registry_agents.sql, with SQLite types: times are
-- INTEGER milliseconds since the Unix epoch (UTC), JSON values are TEXT.

CREATE TABLE agents (
    agent_id        TEXT PRIMARY KEY NOT NULL,
    client_type     TEXT NOT NULL CHECK (client_type IN ('device', 'constellation')),
    platform        TEXT NOT NULL CHECK (platform IN ('windows', 'linux', 'mobile')),
    status          TEXT NOT NULL CHECK (status IN ('available', 'busy', 'offline')),
    offline_reason  TEXT CHECK (offline_reason IN ('unregistered', 'gateway_stopped', 'liveness_expired')),
    capabilities    TEXT NOT NULL DEFAULT '[]',
    tools           TEXT NOT NULL DEFAULT '[]',
    system_info     TEXT,
    metadata        TEXT,
    extensions      TEXT NOT NULL DEFAULT '[]',
    target_id       TEXT,
    principal       TEXT NOT NULL,
    gateway_id      TEXT NOT NULL,
    connection_id   TEXT NOT NULL,
    load            INTEGER NOT NULL DEFAULT 0,
    connected_at    INTEGER NOT NULL,
    last_seen       INTEGER NOT NULL
) STRICT;

CREATE INDEX agents_lookup_idx ON agents (client_type, load, last_seen DESC) WHERE status = 'available';
CREATE INDEX agents_live_gateway_idx ON agents (gateway_id) WHERE status <> 'offline';
CREATE INDEX agents_live_last_seen_idx ON agents (last_seen) WHERE status <> 'offline';

CREATE TABLE gateways (
    gateway_id   TEXT PRIMARY KEY NOT NULL,
    last_seen    INTEGER NOT NULL,
    interval_ms  INTEGER NOT NULL DEFAULT 0
) STRICT;
