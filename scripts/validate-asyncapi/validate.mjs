#!/usr/bin/env node
// Validates an AsyncAPI document with the official parser (@asyncapi/parser v3,
// which runs the AsyncAPI JSON Schema plus the spec's semantic rules: $ref
// resolution, channel/operation/message consistency, unique ids, ...).
//
// Usage: node validate.mjs [--verbose] path/to/asyncapi.json [more.json ...]
//
// Exit status: 0 when no diagnostic of severity "error" was reported
// (warnings are printed but accepted), 1 when at least one error was
// reported, 2 on a usage or I/O problem.
//
// Only local references are allowed: a `$ref` to an http(s) URL is reported
// as an error instead of being fetched, so validation never touches the
// network.

import { readFile } from 'node:fs/promises';
import { resolve } from 'node:path';
import { createRequire } from 'node:module';

// Keep any telemetry of dependencies off, even when called without test.sh.
process.env.SCARF_ANALYTICS ??= 'false';
process.env.DO_NOT_TRACK ??= '1';

const require = createRequire(import.meta.url);
const { Parser, DiagnosticSeverity } = require('@asyncapi/parser');

const SEVERITY_NAMES = {
  [DiagnosticSeverity.Error]: 'error',
  [DiagnosticSeverity.Warning]: 'warning',
  [DiagnosticSeverity.Information]: 'info',
  [DiagnosticSeverity.Hint]: 'hint',
};

function usage(message) {
  if (message) console.error(`validate-asyncapi: ${message}`);
  console.error('usage: node validate.mjs [--verbose] <asyncapi.json> [...]');
  process.exit(2);
}

// RFC 6901 JSON Pointer of a diagnostic's path, e.g. #/operations/x/channel
function pointer(path) {
  if (!Array.isArray(path) || path.length === 0) return '#';
  return '#/' + path.map((p) => String(p).replace(/~/g, '~0').replace(/\//g, '~1')).join('/');
}

// Every `$ref` pointing to an http(s) URL, with the JSON Pointer where it sits.
function remoteRefs(node, path = [], found = []) {
  if (Array.isArray(node)) {
    node.forEach((v, i) => remoteRefs(v, [...path, i], found));
  } else if (node && typeof node === 'object') {
    for (const [k, v] of Object.entries(node)) {
      if (k === '$ref' && typeof v === 'string' && /^https?:/i.test(v)) {
        found.push({ path: [...path, k], ref: v });
      } else {
        remoteRefs(v, [...path, k], found);
      }
    }
  }
  return found;
}

async function validateFile(file, verbose) {
  const source = resolve(file);
  let text;
  try {
    text = await readFile(source, 'utf8');
  } catch (e) {
    console.error(`validate-asyncapi: cannot read ${file}: ${e.message}`);
    return { errors: 1, warnings: 0, io: true };
  }

  let json;
  try {
    json = JSON.parse(text);
  } catch (e) {
    console.error(`error    ${file}: not valid JSON: ${e.message}`);
    console.error(`INVALID  ${file}: not JSON`);
    return { errors: 1, warnings: 0 };
  }

  const remote = remoteRefs(json);
  if (remote.length > 0) {
    for (const r of remote) {
      console.error(`error    no-remote-ref  ${pointer(r.path)}  remote $ref "${r.ref}" is not allowed (validation runs offline)`);
    }
    console.error(`INVALID  ${file}: ${remote.length} remote $ref(s), not parsed`);
    return { errors: remote.length, warnings: 0 };
  }

  const parser = new Parser();
  let output;
  try {
    output = await parser.parse(text, { source });
  } catch (e) {
    console.error(`error    ${file}: the parser failed: ${e && e.stack ? e.stack : e}`);
    return { errors: 1, warnings: 0 };
  }
  const { document, diagnostics = [] } = output;

  let errors = 0;
  let warnings = 0;
  let others = 0;
  const sorted = [...diagnostics].sort((a, b) => a.severity - b.severity);
  for (const d of sorted) {
    const sev = SEVERITY_NAMES[d.severity] ?? `severity-${d.severity}`;
    const line = `${sev.padEnd(8)} ${d.code ?? '-'}  ${pointer(d.path)}  ${d.message}`;
    if (d.severity === DiagnosticSeverity.Error) {
      errors += 1;
      console.error(line);
    } else if (d.severity === DiagnosticSeverity.Warning) {
      warnings += 1;
      console.log(line);
    } else {
      others += 1;
      if (verbose) console.log(line);
    }
  }
  if (!document && errors === 0) {
    console.error(`error    ${file}: the parser returned no document and no error diagnostic`);
    errors += 1;
  }

  const version = document ? document.version() : json.asyncapi;
  const summary = `${file}: AsyncAPI ${version ?? '?'}: ${errors} error(s), ${warnings} warning(s)` +
    (others ? `, ${others} info/hint(s)${verbose ? '' : ' (shown with --verbose)'}` : '');
  if (errors > 0) {
    console.error(`INVALID  ${summary}`);
  } else {
    console.log(`valid    ${summary}`);
  }
  return { errors, warnings };
}

const args = process.argv.slice(2);
const verbose = args.includes('--verbose') || args.includes('-v');
const files = args.filter((a) => a !== '--verbose' && a !== '-v');
if (args.includes('--help') || args.includes('-h')) usage();
if (files.length === 0) usage('no document given');
const unknown = files.filter((f) => f.startsWith('-'));
if (unknown.length) usage(`unknown option(s): ${unknown.join(' ')}`);

let failed = false;
let ioFailed = false;
for (const file of files) {
  const r = await validateFile(file, verbose);
  if (r.errors > 0) failed = true;
  if (r.io) ioFailed = true;
}
process.exit(ioFailed ? 2 : failed ? 1 : 0);
