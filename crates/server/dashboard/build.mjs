// Builds the dashboard into dist/ (committed, and built into the warden binary): the page,
// one script (xterm.js and its fit addon from node_modules, then src/app.js) and one style
// sheet. `node build.mjs --check` builds in memory and fails if dist/ differs (CI runs it).
// Run `npm ci` here first; the versions are pinned in package-lock.json.
import { readFileSync, writeFileSync, mkdirSync, existsSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const read = (p) => readFileSync(join(here, p), 'utf8');
const version = (pkg) => JSON.parse(read(`node_modules/${pkg}/package.json`)).version;
const notice = (pkg) => `/*! ${pkg} ${version(pkg)}\n${read(`node_modules/${pkg}/LICENSE`).trim().replace(/\*\//g, '* /')}\n*/\n`;

const script = [
  '/* The Warden dashboard, built by crates/server/dashboard/build.mjs from src/ and the packages below. */\n',
  notice('@xterm/xterm'), read('node_modules/@xterm/xterm/lib/xterm.js').replace(/\n\/\/# sourceMappingURL=.*$/m, ''), '\n',
  notice('@xterm/addon-fit'), read('node_modules/@xterm/addon-fit/lib/addon-fit.js').replace(/\n\/\/# sourceMappingURL=.*$/m, ''), '\n',
  '(function () {\n', read('src/app.js'), '\n})();\n',
].join('');
const style = [
  `/*! @xterm/xterm ${version('@xterm/xterm')} (MIT, see app.js) */\n`, read('node_modules/@xterm/xterm/css/xterm.css'), '\n',
  read('src/app.css'),
].join('');
const out = { 'index.html': read('src/index.html'), 'app.js': script, 'app.css': style };

const check = process.argv.includes('--check');
let stale = [];
for (const [name, text] of Object.entries(out)) {
  const path = join(here, 'dist', name);
  if (check) {
    if (!existsSync(path) || readFileSync(path, 'utf8') !== text) stale.push(name);
  } else {
    mkdirSync(dirname(path), { recursive: true });
    writeFileSync(path, text);
  }
}
const sizes = Object.entries(out).map(([n, t]) => `${n} ${(Buffer.byteLength(t) / 1024).toFixed(1)} KiB`);
const total = Object.values(out).reduce((s, t) => s + Buffer.byteLength(t), 0);
console.log(`dashboard bundle: ${sizes.join(', ')}; total ${(total / 1024).toFixed(1)} KiB`);
if (stale.length) {
  console.error(`dist/ is not what src/ builds (${stale.join(', ')} differ): run \`npm ci && node build.mjs\` in crates/server/dashboard and commit dist/`);
  process.exit(1);
}
