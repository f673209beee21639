// The Vercel AI SDK (ai + @ai-sdk/openai) running a tool loop against lmspd,
// once with generateText (JSON) and once with streamText (SSE).
// node vercel_tool_loop.mjs NODE_PREFIX BASE_URL MODEL  -> one JSON line
import { createRequire } from 'module';
import path from 'path';

const [prefix, baseURL, modelId] = process.argv.slice(2);
const require = createRequire(path.join(prefix, 'package.json'));
const { generateText, streamText, tool, stepCountIs } = require('ai');
const { createOpenAI } = require('@ai-sdk/openai');
const { z } = require('zod');

const openai = createOpenAI({ baseURL, apiKey: 'unused-locally' });
const model = openai.responses(modelId);
const calls = [];
const tools = {
  get_weather: tool({
    description: 'Get the weather for a city',
    inputSchema: z.object({ city: z.string() }),
    execute: async ({ city }) => { calls.push(city); return `Sunny in ${city}, 21C`; },
  }),
};
const prompt = { system: 'You are helpful.', prompt: "What's the weather in Paris?" };
const out = {};
try {
  const res = await generateText({ model, tools, stopWhen: stepCountIs(4), ...prompt });
  out.generateText = { text: res.text, steps: res.steps.length, finishReason: res.finishReason, calls: [...calls] };
} catch (e) {
  out.generateText = { error: String(e).slice(0, 500) };
}
calls.length = 0;
try {
  const errors = [];
  const res = streamText({ model, tools, stopWhen: stepCountIs(4), ...prompt, onError: ({ error }) => errors.push(String(error).slice(0, 500)) });
  const parts = [];
  for await (const p of res.fullStream) parts.push(p.type);
  out.streamText = { text: await res.text, finishReason: await res.finishReason, calls: [...calls], errors, parts: [...new Set(parts)] };
} catch (e) {
  out.streamText = { error: String(e).slice(0, 500) };
}
console.log(JSON.stringify(out));
