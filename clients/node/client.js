// Stream a chat from a llamastream server: @grpc/grpc-js with the service loaded from
// protos/ at run time by @grpc/proto-loader (no generated code).
//
//   node client.js [--target host:port] [--token T] [--max-tokens N] [--temperature X] chat "Hello"
//
// Streamed text goes to stdout; the finish reason and usage go to stderr as JSON.
"use strict";
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.join(__dirname, "..", "..", "protos");

function loadService() {
  const definition = protoLoader.loadSync("llamastream/v1/generation.proto", {
    includeDirs: [PROTO_ROOT], keepCase: true, longs: Number, enums: String, defaults: false, oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).llamastream.v1.Generation;
}

// Calls `onText(text)` for each delta; resolves with the Finished message, rejects with the gRPC error.
function chat(client, messages, options = {}, metadata = new grpc.Metadata()) {
  const request = { chat: { messages }, sampling: {}, stop: {} };
  if (options.maxTokens !== undefined) request.stop.max_tokens = options.maxTokens;
  if (options.temperature !== undefined) request.sampling.temperature = options.temperature;
  return new Promise((resolve, reject) => {
    let finished = null;
    const call = client.Generate(request, metadata, { deadline: Date.now() + (options.timeoutMs || 600000) });
    call.on("data", (msg) => {
      if (msg.delta && msg.delta.text) options.onText?.(msg.delta.text);  // (a delta may carry ids only)
      if (msg.finished) finished = msg.finished;
    });
    call.on("error", reject);
    call.on("end", () => resolve(finished));
  });
}

function parseArgs(argv) {
  const args = { target: "localhost:50051", positional: [] };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--target") args.target = argv[++i];
    else if (a === "--token") args.token = argv[++i];
    else if (a === "--max-tokens") args.maxTokens = Number(argv[++i]);
    else if (a === "--temperature") args.temperature = Number(argv[++i]);
    else args.positional.push(a);
  }
  return args;
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const [command, text] = args.positional;
  if (command !== "chat" || text === undefined) {
    console.error('usage: node client.js [--target host:port] [--token T] [--max-tokens N] chat "message"');
    process.exit(2);
  }
  const Generation = loadService();
  const client = new Generation(args.target, grpc.credentials.createInsecure());
  const metadata = new grpc.Metadata();
  if (args.token) metadata.add("authorization", `Bearer ${args.token}`);
  try {
    const finished = await chat(client, [{ role: "user", content: text }],
      { maxTokens: args.maxTokens, temperature: args.temperature, onText: (t) => process.stdout.write(t) }, metadata);
    process.stdout.write("\n");
    console.error(JSON.stringify({ reason: finished.reason, usage: finished.usage }));
  } catch (err) {
    console.error(`error: ${grpc.status[err.code]}: ${err.details}`);
    process.exitCode = 1;
  } finally {
    client.close();
  }
}

module.exports = { loadService, chat };
if (require.main === module) main();
