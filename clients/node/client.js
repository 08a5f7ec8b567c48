#!/usr/bin/env node
// Example Node.js client for specd: streams one generation from the GenerateService gateway.
//
//   npm ci                       # once, in clients/node
//   node client.js --address 127.0.0.1:50051 --prompt "Why is the sky blue?"
//   node client.js --prompt "Invent a cat. Answer in JSON." --json-schema cat.schema.json   # structured output
//
// The generated text is written to stdout as it streams; after the stream ends, one line of JSON
// (the summary: text, token ids, finish reason, usage, speculation stats, timings) is printed as
// the last line of stdout. Exit status: 0 on success, 2 on a gRPC error, 64 on bad arguments.
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const USAGE = `usage: node client.js [--address HOST:PORT] --prompt TEXT [options]

  --address HOST:PORT     gateway address (env SPECD_GATEWAY; default 127.0.0.1:50051)
  --prompt TEXT           prompt, sent through the target's chat template as one user message
  --raw                   send the prompt as is, without the chat template
  --max-new-tokens N      tokens to generate (default 64)
  --temperature T         0 = greedy (default 0)
  --top-k K, --top-p P    sampling filters (default off)
  --seed S                sampling seed
  --no-speculation        target-only decoding
  --json-schema FILE      structured output: the answer is JSON valid under this JSON Schema
  --timeout SECONDS       deadline for the whole call (default 600)
  --protos DIR            folder holding specd/v1/*.proto (default ../../protos)
  --quiet                 print only the JSON summary
`;

function parseCommandLine(argv) {
  const { values } = parseArgs({
    args: argv,
    options: {
      address: { type: 'string', default: process.env.SPECD_GATEWAY || '127.0.0.1:50051' },
      prompt: { type: 'string' },
      raw: { type: 'boolean', default: false },
      'max-new-tokens': { type: 'string', default: '64' },
      temperature: { type: 'string', default: '0' },
      'top-k': { type: 'string', default: '0' },
      'top-p': { type: 'string', default: '1' },
      seed: { type: 'string' },
      'no-speculation': { type: 'boolean', default: false },
      'json-schema': { type: 'string' },
      timeout: { type: 'string', default: '600' },
      protos: { type: 'string', default: path.resolve(__dirname, '..', '..', 'protos') },
      quiet: { type: 'boolean', default: false },
      help: { type: 'boolean', default: false },
    },
    strict: true,
  });
  return values;
}

// Load the public API from the .proto files (no generated code): keepCase keeps the proto field
// names (max_new_tokens), longs as strings so uint64 seeds survive, enums as their names.
function loadGenerateService(protosDir) {
  const definition = protoLoader.loadSync('specd/v1/generate.proto', {
    includeDirs: [protosDir],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).specd.v1.GenerateService;
}

function buildRequest(options) {
  const request = {
    text: options.prompt,
    raw: options.raw,
    max_new_tokens: Number.parseInt(options['max-new-tokens'], 10),
    sampling: {
      temperature: Number.parseFloat(options.temperature),
      top_k: Number.parseInt(options['top-k'], 10),
      top_p: Number.parseFloat(options['top-p']),
    },
    disable_speculation: options['no-speculation'],
  };
  if (options.seed !== undefined) request.seed = options.seed; // uint64 as a decimal string
  if (options['json-schema'] !== undefined) {
    // OutputConstraint.json_schema takes the schema as JSON text; parsing it first catches a bad file here
    const schema = JSON.parse(fs.readFileSync(options['json-schema'], 'utf8'));
    request.constraint = { json_schema: JSON.stringify(schema) };
  }
  return request;
}

function main() {
  let options;
  try {
    options = parseCommandLine(process.argv.slice(2));
  } catch (error) {
    process.stderr.write(`${error.message}\n${USAGE}`);
    return process.exit(64);
  }
  if (options.help) {
    process.stdout.write(USAGE);
    return process.exit(0);
  }
  if (!options.prompt) {
    process.stderr.write(`--prompt is required\n${USAGE}`);
    return process.exit(64);
  }

  let request;
  try {
    request = buildRequest(options);
  } catch (error) {
    process.stderr.write(`--json-schema: ${error.message}\n`);
    return process.exit(64);
  }
  const GenerateService = loadGenerateService(options.protos);
  const client = new GenerateService(options.address, grpc.credentials.createInsecure());
  const deadline = new Date(Date.now() + Number.parseFloat(options.timeout) * 1000);
  const started = process.hrtime.bigint();
  const secondsSince = (t) => Number(process.hrtime.bigint() - t) / 1e9;

  const summary = {
    text: '',
    token_ids: [],
    prompt_token_ids: [],
    finish_reason: null,
    usage: null,
    stats: null,
    messages: 0,
    time_to_first_token_s: null,
    elapsed_s: null,
  };

  const call = client.GenerateStream(request, { deadline });
  call.on('data', (message) => {
    summary.messages += 1;
    if (message.token_ids.length > 0 && summary.time_to_first_token_s === null) {
      summary.time_to_first_token_s = secondsSince(started);
    }
    if (message.prompt_token_ids.length > 0) summary.prompt_token_ids = message.prompt_token_ids;
    summary.text += message.text;
    summary.token_ids.push(...message.token_ids);
    if (message.finish_reason && message.finish_reason !== 'FINISH_REASON_UNSPECIFIED') {
      summary.finish_reason = message.finish_reason.replace(/^FINISH_REASON_/, '').toLowerCase();
      summary.usage = message.usage;
      summary.stats = message.stats;
    }
    if (!options.quiet) process.stdout.write(message.text);
  });
  call.on('error', (error) => {
    process.stderr.write(`specd client: ${grpc.status[error.code] || error.code}: ${error.details}\n`);
    client.close();
    process.exitCode = 2;
  });
  call.on('end', () => {
    summary.elapsed_s = secondsSince(started);
    if (!options.quiet) process.stdout.write('\n');
    process.stdout.write(`${JSON.stringify(summary)}\n`);
    client.close();
  });
}

main();
