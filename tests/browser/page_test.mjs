// Headless browser test of the chat page served by `fathom serve` at GET /.
//
//   FATHOM_URL=http://127.0.0.1:18080 node tests/browser/page_test.mjs
//
// Env: FATHOM_URL (server base URL), CHROMIUM (browser binary, default
// /usr/bin/chromium), OUT_DIR (optional: page-failure.png is saved there on
// failure). playwright-core is resolved through NODE_PATH.
import { createRequire } from 'node:module';
import path from 'node:path';

const require = createRequire(import.meta.url);
const { chromium } = require('playwright-core');

const BASE = (process.env.FATHOM_URL || 'http://127.0.0.1:18080').replace(/\/+$/, '');
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';
const OUT_DIR = process.env.OUT_DIR || '';
const PROMPT = 'def add(a, b):';
const TOTAL_TIMEOUT_MS = 120_000;

let browser = null;
let page = null;
let checks = 0;
const pageLog = [];

function pass(what) {
  checks += 1;
  console.log(`ok - ${what}`);
}

class CheckError extends Error {}

function check(cond, what, detail = '') {
  if (!cond) throw new CheckError(detail ? `${what}: ${detail}` : what);
  pass(what);
}

async function fail(reason) {
  console.log(`FAIL: ${reason}`);
  for (const line of pageLog.slice(-20)) console.log(`  page: ${line}`);
  if (OUT_DIR && page) {
    try {
      const file = path.join(OUT_DIR, 'page-failure.png');
      await page.screenshot({ path: file, fullPage: true, timeout: 5_000 });
      console.log(`screenshot: ${file}`);
    } catch (e) {
      console.log(`screenshot failed: ${e.message}`);
    }
  }
  process.exit(1);
}

const timer = setTimeout(() => {
  fail(`test did not finish within ${TOTAL_TIMEOUT_MS / 1000} s`);
}, TOTAL_TIMEOUT_MS);

async function main() {
  browser = await chromium.launch({
    executablePath: CHROMIUM,
    headless: true,
    args: [
      '--no-sandbox',
      '--disable-gpu',
      '--disable-quic',
      '--no-first-run',
      '--disable-background-networking',
      '--disable-component-update',
      '--disable-sync',
    ],
  });
  const context = await browser.newContext();
  page = await context.newPage();
  page.on('console', (m) => pageLog.push(`console.${m.type()}: ${m.text()}`));
  page.on('pageerror', (e) => pageLog.push(`pageerror: ${e.message}`));
  const pageErrors = [];
  page.on('pageerror', (e) => pageErrors.push(e.message));

  // Remember the chat request the page sends.
  let chatBody = null;
  page.on('request', (req) => {
    if (req.method() === 'POST' && req.url().endsWith('/v1/chat/completions')) {
      try { chatBody = JSON.parse(req.postData() || 'null'); } catch { chatBody = 'unparsable'; }
    }
  });

  const res = await page.goto(`${BASE}/`, { waitUntil: 'domcontentloaded', timeout: 30_000 });
  check(res && res.ok(), 'GET / returns the page', res ? `status ${res.status()}` : 'no response');

  await page.waitForSelector('#model[data-loaded="true"]', { timeout: 30_000 });
  const model = (await page.textContent('#model')).trim();
  check(model.length > 0, `model id shown in the header (${model})`);

  await page.uncheck('#thinking');
  await page.fill('#max-tokens', '16');
  await page.fill('#prompt', PROMPT);
  await page.click('#send');

  const done = '.msg.assistant[data-done="true"]';
  await page.waitForSelector(done, { timeout: 60_000 });
  pass('assistant message finished (data-done="true")');

  const errors = await page.$$eval(`${done} .error`, (els) => els.map((e) => e.textContent));
  check(errors.length === 0, 'no error in the assistant message', errors.join(' | '));

  const answer = await page.$eval(`${done} .content`, (e) => e.textContent);
  check(answer.length > 0, `assistant answer is non-empty (${JSON.stringify(answer.slice(0, 60))})`);

  const usage = await page.$$eval(`${done} .meta`, (els) => els.map((e) => e.textContent).join(' '));
  check(/\d+ tokens · [\d.]+ tok\/s/.test(usage), `usage line shown (${usage})`);

  check(
    chatBody && typeof chatBody === 'object' && chatBody.stream === true &&
      chatBody.max_tokens === 16 && chatBody.model === model &&
      chatBody.chat_template_kwargs && chatBody.chat_template_kwargs.thinking === false,
    'request carries model, stream, max_tokens 16 and thinking false',
    JSON.stringify(chatBody),
  );

  const user = await page.$eval('.msg.user', (e) => e.textContent);
  check(user.trim() === PROMPT, 'user bubble shows the prompt', JSON.stringify(user));

  // The engine panel polls /stats every second.
  let generated = NaN;
  const until = Date.now() + 5_000;
  for (;;) {
    const text = (await page.textContent('#stat-generated')) || '';
    generated = parseInt(text.replace(/[^\d]/g, ''), 10);
    if (generated > 0 || Date.now() > until) break;
    await page.waitForTimeout(250);
  }
  check(generated > 0, `#stat-generated shows a count > 0 (${generated})`);

  check(pageErrors.length === 0, 'no uncaught errors in the page', pageErrors.join(' | '));

  await browser.close();
  browser = null;
  clearTimeout(timer);
  console.log(`browser: ${checks} checks passed`);
  process.exit(0);
}

main().catch((e) => fail(e instanceof CheckError ? e.message : (e && e.stack) || String(e)));
