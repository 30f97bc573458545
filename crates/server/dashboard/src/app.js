// The dashboard: one page over the daemon's own API. Everything it shows comes from the API's
// typed answers; everything live comes from the events stream (`/v1/events?usage=true`), never
// from polling. Text from cells, the journal and models is put in the page as text only.
'use strict';

// The session's CSRF token, kept in this origin's storage (a page of another port of this host
// cannot read it, though the browser sends it the session cookie): every request made with the
// cookie carries it.
const CSRF_KEY = 'warden.csrf';
const storedCsrf = () => { try { return localStorage.getItem(CSRF_KEY) || ''; } catch { return ''; } };
function keepCsrf(csrf) {
  state.csrf = csrf || '';
  try { if (state.csrf) localStorage.setItem(CSRF_KEY, state.csrf); else localStorage.removeItem(CSRF_KEY); } catch { /* no storage: this tab only */ }
}
// A GET the page cannot add a header to (its events stream, a terminal's WebSocket) carries the
// token in its query.
const withCsrf = (path) => state.csrf ? `${path}${path.includes('?') ? '&' : '?'}csrf=${enc(state.csrf)}` : path;

const state = {
  csrf: storedCsrf(),
  via: '',
  cells: [],
  usage: new Map(), // cell -> [CellUsage]
  approvals: [],
  agents: [],
  view: '',
  params: [],
  refresh: null, // what the current view re-reads when an entry concerns it
  cleanup: [], // what leaving the view closes (terminals, sockets)
  events: null,
};

// ---------- small helpers ----------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else if (k === 'class') el.className = v;
    else if (k === 'dataset') Object.assign(el.dataset, v);
    else el.setAttribute(k, v === true ? '' : v);
  }
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

const $ = (sel) => document.querySelector(sel);

function toast(text, bad) {
  const el = h('div', { class: bad ? 'bad' : '' }, text);
  $('#toast').append(el);
  setTimeout(() => el.remove(), bad ? 8000 : 3000);
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(method, path, body) {
  const headers = {};
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  // A login in another tab replaced the session (and the stored token) since this one read it.
  if (state.via === 'cookie') state.csrf = storedCsrf() || state.csrf;
  if (state.csrf) headers['X-Warden-CSRF'] = state.csrf;
  const res = await fetch(path, {
    method, headers, credentials: 'same-origin',
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (res.status === 401 && path !== '/ui/login') { showLogin(); throw new ApiError(401, 'log in first'); }
  const text = await res.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = text; }
  if (!res.ok) throw new ApiError(res.status, (data && data.error) || `${res.status} ${res.statusText}`);
  return data;
}

// Runs an action from a button; its error is shown, never thrown away.
function act(button, work, done) {
  return async () => {
    if (button) button.disabled = true;
    try { const r = await work(); if (done) toast(done); return r; }
    catch (e) { toast(e.message, true); }
    finally { if (button) button.disabled = false; }
  };
}

function button(label, work, opts = {}) {
  const b = h('button', { class: opts.class, title: opts.title, dataset: opts.dataset }, label);
  b.addEventListener('click', act(b, work, opts.done));
  return b;
}

const enc = encodeURIComponent;
const age = (ms) => {
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h`;
  return `${Math.floor(s / 86400)}d`;
};
const time = (ms) => new Date(ms).toLocaleTimeString();
const bytes = (n) => n == null ? '–' : n < 1024 ? `${n} B` : n < 1 << 20 ? `${(n / 1024).toFixed(1)} KiB`
  : n < 1 << 30 ? `${(n / (1 << 20)).toFixed(1)} MiB` : `${(n / (1 << 30)).toFixed(2)} GiB`;

function spark(values, title) {
  const w = 90, hgt = 22;
  const svg = document.createElementNS('http://www.w3.org/2000/svg', 'svg');
  svg.setAttribute('width', w); svg.setAttribute('height', hgt); svg.setAttribute('class', 'spark');
  const t = document.createElementNS('http://www.w3.org/2000/svg', 'title'); t.textContent = title; svg.append(t);
  if (values.length > 1) {
    const max = Math.max(...values, 1e-9);
    const pts = values.map((v, i) => `${(i / (values.length - 1)) * w},${hgt - 2 - (v / max) * (hgt - 4)}`);
    const line = document.createElementNS('http://www.w3.org/2000/svg', 'polyline');
    line.setAttribute('points', pts.join(' '));
    svg.append(line);
  }
  return svg;
}

// CPU share (percent of one core), memory and tasks of a cell, from its samples.
function usageSeries(name) {
  const s = state.usage.get(name) || [];
  const cpu = [];
  for (let i = 1; i < s.length; i++) {
    const dt = (s[i].time_ms - s[i - 1].time_ms) * 1000;
    const du = (s[i].cpu_usec ?? 0) - (s[i - 1].cpu_usec ?? 0);
    cpu.push(dt > 0 ? Math.max(0, (du / dt) * 100) : 0);
  }
  return { cpu, mem: s.map((x) => x.memory_bytes ?? 0), pids: s.map((x) => x.pids ?? 0), last: s[s.length - 1] };
}

// ---------- login ----------

function showLogin() {
  $('#login').hidden = false;
  $('#view').hidden = true;
  $('#nav').hidden = true;
  $('#logout').hidden = true;
  $('#token').focus();
}

async function logIn(token) {
  try {
    const r = await api('POST', '/ui/login', { token });
    keepCsrf(r.csrf);
    $('#login-error').textContent = '';
    await start();
  } catch (e) {
    showLogin();
    $('#login-error').textContent = e.message;
  }
}

async function start() {
  let session;
  // A cookie without the token this page kept (storage cleared) is refused: log in again.
  try { session = await api('GET', '/ui/session'); } catch { showLogin(); return; }
  if (session.via === 'cookie') keepCsrf(session.csrf); else state.csrf = '';
  state.via = session.via;
  $('#login').hidden = true;
  $('#view').hidden = false;
  $('#nav').hidden = false;
  $('#logout').hidden = session.via !== 'cookie';
  await Promise.all([loadCells(), loadApprovals(), loadUsage()]);
  follow();
  route();
}

// ---------- live ----------

let pending = null;
function soon(what) {
  // Several entries in a burst make one re-read.
  pending = pending || new Set();
  pending.add(what);
  clearTimeout(soon.timer);
  soon.timer = setTimeout(async () => {
    const set = pending; pending = null;
    if (set.has('cells')) await loadCells().catch(() => {});
    if (set.has('approvals')) await loadApprovals().catch(() => {});
    if (set.has('view') && state.refresh) await state.refresh().catch(() => {});
  }, 150);
}

function follow() {
  if (state.events) state.events.close();
  const es = new EventSource(withCsrf('/v1/events?usage=true'));
  state.events = es;
  es.addEventListener('open', () => { $('#live').textContent = 'live'; $('#live').classList.remove('off'); });
  es.addEventListener('error', () => {
    $('#live').textContent = 'reconnecting'; $('#live').classList.add('off');
    // A login in another tab gave a new token: the stream reconnects with it.
    if (state.via === 'cookie' && storedCsrf() && storedCsrf() !== state.csrf) { state.csrf = storedCsrf(); follow(); }
  });
  es.addEventListener('entry', (ev) => {
    const entry = JSON.parse(ev.data);
    const kind = entry.kind || '';
    if (kind.startsWith('cell.') || kind.startsWith('exec.') || kind.startsWith('workspace.')) soon('cells');
    if (kind.startsWith('approval.') || kind === 'exec.denied') soon('approvals');
    for (const f of listeners) f(entry);
    soon('view');
  });
  es.addEventListener('usage', (ev) => {
    for (const { cell, usage } of JSON.parse(ev.data)) {
      const list = state.usage.get(cell) || [];
      list.push(usage);
      if (list.length > 120) list.shift();
      state.usage.set(cell, list);
    }
    for (const f of usageListeners) f();
  });
}

const listeners = new Set();
const usageListeners = new Set();
function onEntry(f) { listeners.add(f); state.cleanup.push(() => listeners.delete(f)); }
function onUsage(f) { usageListeners.add(f); state.cleanup.push(() => usageListeners.delete(f)); }

async function loadCells() { state.cells = await api('GET', '/v1/cells'); if (state.view === 'cells') renderCells(); }
async function loadUsage() {
  for (const u of await api('GET', '/v1/usage')) state.usage.set(u.cell, u.samples);
}
async function loadApprovals() {
  state.approvals = await api('GET', '/v1/approvals');
  const badge = $('#badge');
  badge.textContent = String(state.approvals.length);
  badge.hidden = state.approvals.length === 0;
  if (state.view === 'approvals') renderApprovals();
}

// ---------- routing ----------

const views = { cells: viewCells, cell: viewCell, journal: viewJournal, network: viewNetwork,
  approvals: viewApprovals, agents: viewAgents, agent: viewAgent };

function route() {
  for (const f of state.cleanup.splice(0)) { try { f(); } catch { /* closed already */ } }
  const [view, ...params] = (location.hash.replace(/^#\/?/, '') || 'cells').split('/').map(decodeURIComponent);
  state.view = views[view] ? view : 'cells';
  state.params = params;
  state.refresh = null;
  for (const a of document.querySelectorAll('#nav a')) {
    const v = a.dataset.view;
    a.classList.toggle('active', v === state.view || (v === 'cells' && state.view === 'cell') || (v === 'agents' && state.view === 'agent'));
  }
  const el = $('#view');
  el.replaceChildren();
  views[state.view](el, ...params);
}

// ---------- cells ----------

function viewCells(el) {
  el.append(h('h1', {}, 'Cells'), h('div', { id: 'cells' }));
  renderCells();
  onUsage(renderCells);
}

function renderCells() {
  const box = $('#cells');
  if (!box) return;
  const rows = state.cells.map((c) => {
    const u = usageSeries(c.name);
    const live = c.state !== 'ended';
    return h('tr', { class: 'clickable', dataset: { cell: c.name } },
      h('td', {}, h('a', { href: `#/cell/${enc(c.name)}` }, c.name)),
      h('td', {}, h('span', { class: `state ${c.state}` }, c.state)),
      h('td', {}, c.tier || 'process'),
      h('td', {}, c.preset || h('span', { class: 'muted' }, 'custom')),
      h('td', { title: new Date(c.created_ms).toString() }, age(c.created_ms)),
      h('td', {}, spark(u.cpu, 'CPU % of one core'), ' ', u.cpu.length ? `${u.cpu[u.cpu.length - 1].toFixed(1)}%` : '–'),
      h('td', {}, spark(u.mem, 'memory'), ' ', bytes(u.last?.memory_bytes)),
      h('td', {}, spark(u.pids, 'tasks'), ' ', u.last?.pids ?? '–'),
      h('td', { class: 'actions' }, live ? cellButtons(c) : []));
  });
  box.replaceChildren(state.cells.length === 0 ? h('p', { class: 'muted' }, 'No cells yet. `warden create NAME` or POST /v1/cells makes one.') :
    h('table', {}, h('thead', {}, h('tr', {}, ['name', 'state', 'tier', 'preset', 'age', 'cpu', 'memory', 'tasks', ''].map((t) => h('th', {}, t)))),
      h('tbody', {}, rows)));
}

function cellButtons(c) {
  const path = `/v1/cells/${enc(c.name)}`;
  const list = [];
  if (c.state === 'paused') list.push(button('Resume', () => api('POST', `${path}/resume`), { dataset: { act: 'resume' } }));
  else list.push(button('Pause', () => api('POST', `${path}/pause`), { dataset: { act: 'pause' } }));
  list.push(button('Snapshot', async () => { const s = await api('POST', `${path}/snapshot`, {}); toast(`snapshot ${s.id}`); }, { dataset: { act: 'snapshot' } }));
  list.push(button('Reset', async () => { if (confirm(`Reset ${c.name}'s workspace to where it started?`)) await api('POST', `${path}/reset`, {}); }, { dataset: { act: 'reset' } }));
  list.push(button('Fork', async () => {
    const s = await api('POST', `${path}/snapshot`, {});
    const made = await api('POST', '/v1/cells', { from: s.id });
    toast(`forked into ${made.name}`);
  }, { dataset: { act: 'fork' } }));
  list.push(button('Kill', async () => { if (confirm(`Kill every process of ${c.name}?`)) await api('POST', `${path}/kill`); }, { class: 'danger', dataset: { act: 'kill' } }));
  return list;
}

function viewCell(el, name) {
  const path = `/v1/cells/${enc(name)}`;
  const head = h('div', { class: 'row' });
  const procs = h('div', {});
  const term = h('div', { class: 'term', id: 'term' });
  const termTitle = h('span', { class: 'muted', id: 'term-title' }, 'no process attached');
  const diffBox = h('div', { id: 'diff' });
  el.append(h('h1', {}, h('a', { href: '#/cells' }, 'Cells'), ' / ', name), head,
    h('h2', {}, 'Processes'), procs,
    h('h2', {}, 'Terminal ', termTitle), h('div', { class: 'actions', style: 'margin-bottom:.5rem' },
      button('New shell', () => newShell(name), { dataset: { act: 'shell' } })), term,
    h('h2', {}, 'Workspace changes'), diffBox);

  const renderHead = () => {
    const c = state.cells.find((x) => x.name === name);
    if (!c) { head.replaceChildren(h('p', { class: 'error' }, `no cell ${name}`)); return; }
    const u = usageSeries(name);
    head.replaceChildren(h('div', { class: 'panel' },
      h('div', {}, h('span', { class: `state ${c.state}`, id: 'cell-state' }, c.state), ` · tier ${c.tier} · ${c.preset || 'custom policy'} · made ${age(c.created_ms)} ago`,
        c.workspace ? ` · workspace ${c.workspace}` : ''),
      h('div', { style: 'margin:.5rem 0' }, 'cpu ', spark(u.cpu, 'CPU %'), ' memory ', spark(u.mem, 'memory'), ` ${bytes(u.last?.memory_bytes)}`, ' tasks ', spark(u.pids, 'tasks'), ` ${u.last?.pids ?? '–'}`),
      c.state !== 'ended' ? h('div', { class: 'actions' }, cellButtons(c)) : h('div', { class: 'muted' }, c.ended || '')));
  };
  const loadProcs = async () => {
    let list = [];
    try { list = await api('GET', `${path}/processes`); } catch (e) { procs.replaceChildren(h('p', { class: 'error' }, e.message)); return; }
    procs.replaceChildren(list.length === 0 ? h('p', { class: 'muted' }, 'none') : h('table', {},
      h('thead', {}, h('tr', {}, ['id', 'command', 'started', 'state', ''].map((t) => h('th', {}, t)))),
      h('tbody', {}, list.slice().reverse().map((p) => h('tr', { dataset: { process: p.id } },
        h('td', {}, p.id), h('td', { class: 'mono' }, p.argv.join(' ')), h('td', {}, time(p.started_ms)),
        h('td', {}, p.running ? 'running' : exitText(p.exit)),
        h('td', {}, button(p.running ? 'Attach' : 'Output', () => attach(name, p), { dataset: { act: 'attach' } })))))));
  };
  // What the operator is reviewing: the changes as first shown (their digest), the paths
  // they chose or left out, the change on view. The cell may change its workspace meanwhile
  // (every exec reloads the diff): a reload never undoes a choice, and Apply stays bound to the
  // changes that were looked at until the operator looks again.
  const review = { digest: null, choice: new Map(), shown: null };
  renderHead(); loadProcs(); loadDiff(name, diffBox, review);
  onUsage(renderHead);
  state.refresh = async () => { await loadCells(); renderHead(); await loadProcs(); };
  onEntry((e) => { if (e.cell === name && (e.kind.startsWith('workspace.') || e.kind === 'exec.exit' || e.kind.startsWith('file.'))) loadDiff(name, diffBox, review); });
}

function exitText(exit) {
  if (!exit) return 'ended';
  if (exit.reason === 'exited') return `exited ${exit.code}`;
  if (exit.reason === 'signaled') return `signal ${exit.signal}`;
  return exit.reason + (exit.message ? `: ${exit.message}` : '');
}

// A terminal on one process, over the API's WebSocket attach (output from the start, then
// live; keys go to its stdin).
let terminal = null;
function openTerminal() {
  const el = $('#term');
  if (!el) return null;
  if (terminal) { terminal.dispose(); terminal = null; }
  el.replaceChildren();
  const term = new Terminal({ convertEol: false, fontSize: 13, cursorBlink: true, theme: { background: '#000000' } });
  const fit = new FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open(el);
  try { fit.fit(); } catch { /* not visible */ }
  terminal = term;
  state.cleanup.push(() => { term.dispose(); if (terminal === term) terminal = null; });
  return { term, fit };
}

function attach(cell, proc, tty) {
  const t = openTerminal();
  if (!t) return;
  const { term } = t;
  const isTty = tty ?? !!proc.tty;
  $('#term-title').textContent = `process ${proc.id}: ${(proc.argv || []).join(' ')}`;
  const proto = location.protocol === 'https:' ? 'wss' : 'ws';
  const ws = new WebSocket(`${proto}://${location.host}${withCsrf(`/v1/cells/${enc(cell)}/processes/${proc.id}/attach`)}`);
  state.cleanup.push(() => ws.close());
  const decoder = { stdout: new TextDecoder(), stderr: new TextDecoder() };
  ws.addEventListener('message', (ev) => {
    const m = JSON.parse(ev.data);
    if (m.event === 'stdout' || m.event === 'stderr') {
      let text = m.text ?? (m.base64 ? decoder[m.event].decode(Uint8Array.from(atob(m.base64), (c) => c.charCodeAt(0)), { stream: true }) : '');
      if (!isTty) text = text.replace(/\r?\n/g, '\r\n');
      term.write(text);
    } else if (m.event === 'dropped') {
      term.write(`\r\n[${m.bytes} bytes dropped]\r\n`);
    } else if (m.event === 'exit') {
      term.write(`\r\n[${exitText(m)}]\r\n`);
      $('#term-title').textContent += ` (${exitText(m)})`;
    }
  });
  ws.addEventListener('close', () => term.write('\r\n[detached]\r\n'));
  term.onData((data) => { if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ stdin: data })); });
  term.onResize(({ rows, cols }) => { if (isTty && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ resize: { rows, cols } })); });
  term.focus();
}

async function newShell(cell) {
  const t = openTerminal();
  const rows = t ? t.term.rows : 24, cols = t ? t.term.cols : 80;
  const proc = await api('POST', `/v1/cells/${enc(cell)}/exec`, { argv: ['/bin/sh', '-i'], tty: { rows, cols }, background: true });
  attach(cell, proc, true);
}

// ---------- workspace ----------

async function loadDiff(cell, box, review) {
  let diff;
  try { diff = await api('GET', `/v1/cells/${enc(cell)}/diff`); } catch (e) { box.replaceChildren(h('p', { class: 'muted' }, e.message)); return; }
  if (diff.changes.length === 0) { box.replaceChildren(h('p', { class: 'muted' }, 'no changes')); return; }
  if (review.digest === null) review.digest = diff.digest;
  // Chosen: what is chosen by default (neither refused nor sensitive), unless the operator
  // chose otherwise, which a reload keeps.
  const chosen = new Set(diff.changes
    .filter((c) => !c.refused && (review.choice.get(c.path) ?? !c.sensitive))
    .map((c) => c.path));
  const shown = h('div', {});
  const tree = h('div', { class: 'tree' });
  let lastDir = null;
  for (const c of diff.changes) {
    const dir = c.path.includes('/') ? c.path.slice(0, c.path.lastIndexOf('/')) : '';
    if (dir !== lastDir) { if (dir) tree.append(h('div', { class: 'dir' }, `${dir}/`)); lastDir = dir; }
    const box2 = h('input', { type: 'checkbox', checked: chosen.has(c.path), disabled: !!c.refused, dataset: { path: c.path } });
    box2.addEventListener('change', () => {
      review.choice.set(c.path, box2.checked);
      if (box2.checked) chosen.add(c.path); else chosen.delete(c.path);
    });
    const name = h('span', { class: 'clickable', dataset: { show: c.path }, title: 'show the change' },
      h('span', { class: c.kind === 'deleted' ? 'error' : c.kind === 'added' ? '' : 'muted' }, c.kind[0].toUpperCase()), ' ',
      c.path.slice(dir ? dir.length + 1 : 0));
    name.addEventListener('click', () => { review.shown = c.path; showChange(shown, c); });
    const label = h('div', { class: 'change', style: dir ? 'padding-left:1rem' : '' }, box2, ' ', name,
      c.refused ? h('span', { class: 'error' }, ` (${c.refused})`) : '', c.sensitive ? h('span', { class: 'muted' }, ` (sensitive: ${c.sensitive})`) : '');
    tree.append(label);
  }
  // The changes moved since they were looked at: Apply waits until the operator looks again.
  const moved = diff.digest !== review.digest;
  const apply = button('Apply chosen', async () => {
    const paths = [...chosen];
    if (paths.length === 0) throw new Error('choose at least one path');
    toast('applying (the policy may ask for an approval first)');
    const r = await api('POST', `/v1/cells/${enc(cell)}/apply`, { paths, digest: review.digest, include_sensitive: paths.some((p) => diff.changes.find((c) => c.path === p)?.sensitive) });
    toast(`applied ${r.applied.length}${r.skipped.length ? `, skipped ${r.skipped.map((s) => s.join(': ')).join('; ')}` : ''}`);
    review.digest = null; review.choice.clear(); review.shown = null;
    loadDiff(cell, box, review);
  }, { class: 'primary', dataset: { act: 'apply' } });
  apply.disabled = moved;
  const again = moved ? h('div', { class: 'error', id: 'diff-moved' },
    'The cell changed its workspace since you began this review: look at the changes again. ',
    button('Review again', async () => { review.digest = diff.digest; loadDiff(cell, box, review); }, { dataset: { act: 'review-again' } })) : '';
  box.replaceChildren(h('div', { class: 'diff' }, h('div', {}, again, tree, h('div', { style: 'margin-top:.6rem' }, apply)), shown));
  showChange(shown, diff.changes.find((c) => c.path === review.shown) ?? diff.changes[0]);
}

// A unified patch side by side: removed lines left, added right, context on both.
function showChange(box, c) {
  const title = h('div', { class: 'mono', style: 'margin-bottom:.4rem' }, `${c.kind} ${c.path}`, c.size != null ? ` (${bytes(c.size)})` : '');
  if (!c.patch) { box.replaceChildren(title, h('p', { class: 'muted' }, c.entry === 'file' ? 'no text diff (binary or large)' : c.entry)); return; }
  const rows = [];
  let left = [], right = [];
  const flush = () => {
    const n = Math.max(left.length, right.length);
    for (let i = 0; i < n; i++) rows.push(h('div', { class: left[i] !== undefined ? 'del' : '' }, left[i] ?? ''), h('div', { class: right[i] !== undefined ? 'add' : '' }, right[i] ?? ''));
    left = []; right = [];
  };
  for (const line of c.patch.split('\n')) {
    if (line.startsWith('---') || line.startsWith('+++')) continue;
    if (line.startsWith('@@')) { flush(); rows.push(h('div', { class: 'muted' }, line), h('div', { class: 'muted' }, '')); continue; }
    if (line.startsWith('-')) left.push(line.slice(1));
    else if (line.startsWith('+')) right.push(line.slice(1));
    else { flush(); const t = line.slice(1); rows.push(h('div', {}, t), h('div', {}, t)); }
  }
  flush();
  box.replaceChildren(title, h('div', { class: 'sbs' }, rows));
}

// ---------- journal ----------

function viewJournal(el) {
  const cell = h('input', { placeholder: 'cell', id: 'f-cell' });
  const kind = h('input', { placeholder: 'kind prefix (net., exec.)', id: 'f-kind' });
  const since = h('input', { type: 'datetime-local', id: 'f-since', title: 'since' });
  const list = h('tbody', {});
  const more = h('button', { hidden: true }, 'Older');
  const verdict = h('span', { id: 'verify-result' });
  let next = null;
  const query = (before) => {
    const q = new URLSearchParams({ limit: '200' });
    if (cell.value) q.set('cell', cell.value);
    if (kind.value) q.set('kind', kind.value);
    if (since.value) q.set('since_ms', String(new Date(since.value).getTime()));
    if (before) q.set('before', String(before));
    return q;
  };
  const row = (e) => {
    const tr = h('tr', { class: 'clickable', dataset: { seq: e.seq } }, h('td', {}, e.seq), h('td', {}, e.time_ms ? time(e.time_ms) : ''),
      h('td', {}, e.cell || ''), h('td', { class: 'mono' }, e.kind), h('td', { class: 'mono muted' }, summary(e)));
    tr.addEventListener('click', () => openEntry(e.seq));
    return tr;
  };
  const load = async (append) => {
    const page = await api('GET', `/v1/journal?${query(append ? next : null)}`);
    next = page.next_before;
    more.hidden = !next;
    if (!append) list.replaceChildren();
    list.append(...page.entries.map(row));
  };
  more.addEventListener('click', act(more, () => load(true)));
  for (const f of [cell, kind, since]) f.addEventListener('change', () => load(false).catch((e) => toast(e.message, true)));
  el.append(h('h1', {}, 'Journal'), h('div', { class: 'filters' }, cell, kind, since,
    button('Verify chain', async () => {
      const r = await api('GET', '/v1/journal/verify');
      verdict.className = r.ok ? '' : 'error';
      verdict.textContent = r.ok ? `chain holds: entries ${r.first_seq}–${r.last_seq}, ${r.checkpoints} signed checkpoints, ${r.unsigned_tail} after the last` : `broken: ${r.error}`;
    }, { dataset: { act: 'verify' } }), verdict),
  h('table', {}, h('thead', {}, h('tr', {}, ['seq', 'time', 'cell', 'kind', 'data'].map((t) => h('th', {}, t)))), list), more);
  load(false).catch((e) => toast(e.message, true));
  onEntry((e) => {
    if (cell.value && e.cell !== cell.value) return;
    if (kind.value && !e.kind.startsWith(kind.value)) return;
    list.prepend(row({ ...e, time_ms: Date.now() }));
  });
}

function summary(e) {
  const d = e.data || {};
  const parts = [];
  for (const k of ['argv', 'host', 'method', 'path', 'code', 'reason', 'rule', 'by', 'paths']) {
    if (d[k] === undefined || d[k] === null) continue;
    parts.push(`${k}=${Array.isArray(d[k]) ? d[k].join(' ') : typeof d[k] === 'object' ? JSON.stringify(d[k]) : d[k]}`);
  }
  const text = parts.join(' ') || JSON.stringify(d);
  return text.length > 160 ? `${text.slice(0, 160)}…` : text;
}

async function openEntry(seq) {
  const page = await api('GET', `/v1/journal?before=${seq + 1}&limit=1`);
  const e = page.entries[0];
  if (!e) return;
  const dlg = h('dialog', { id: 'entry' },
    h('h1', {}, `Entry ${e.seq}: ${e.kind}`),
    h('p', {}, `${new Date(e.time_ms).toString()}${e.cell ? ` · cell ${e.cell}` : ''}`),
    h('p', { class: 'mono' }, 'hash ', h('span', { id: 'entry-hash' }, e.hash)),
    h('p', { class: 'mono muted' }, `prev ${e.prev} (entry ${e.seq - 1})`),
    h('p', { class: 'muted' }, `entry ${e.seq} of ${page.head_seq}; its hash covers seq, time, cell, kind, data and prev`),
    h('pre', {}, JSON.stringify(e.data, null, 2)),
    h('form', { method: 'dialog' }, h('button', {}, 'Close')));
  document.body.append(dlg);
  dlg.addEventListener('close', () => dlg.remove());
  dlg.showModal();
}

// ---------- network ----------

function viewNetwork(el) {
  const cell = h('input', { placeholder: 'cell', id: 'n-cell' });
  const verdict = h('select', { id: 'n-verdict' }, h('option', { value: '' }, 'all'), h('option', { value: 'denied' }, 'denied'), h('option', { value: 'allowed' }, 'allowed'));
  const host = h('input', { placeholder: 'destination contains', id: 'n-host' });
  const list = h('tbody', { id: 'net' });
  let entries = [];
  const render = () => {
    const rows = entries.filter((e) => {
      const d = e.data;
      if (cell.value && e.cell !== cell.value) return false;
      if (verdict.value === 'denied' && d.allowed) return false;
      if (verdict.value === 'allowed' && !d.allowed) return false;
      if (host.value && !`${d.host}:${d.port}`.includes(host.value)) return false;
      return true;
    }).map((e) => {
      const d = e.data;
      return h('tr', { class: d.allowed ? '' : 'denied', dataset: { seq: e.seq } },
        h('td', {}, d.time_unix_ms ? time(d.time_unix_ms) : ''), h('td', {}, e.cell || d.cell || ''),
        h('td', { class: `verdict ${d.allowed ? 'allowed' : ''}` }, d.allowed ? 'allowed' : 'denied'),
        h('td', { class: 'mono' }, `${d.host}:${d.port}`), h('td', {}, d.kind), h('td', {}, d.method || ''),
        h('td', { class: 'mono' }, d.path || ''), h('td', { class: 'mono' }, d.rule || ''),
        h('td', { class: d.allowed ? 'muted' : 'error' }, d.reason || ''),
        h('td', {}, `${bytes(d.bytes_up)} ↑ ${bytes(d.bytes_down)} ↓${d.repeats ? ` ×${d.repeats}` : ''}`));
    });
    list.replaceChildren(...rows);
  };
  for (const f of [cell, verdict, host]) f.addEventListener('input', render);
  // The newest 500 decisions, then older ones a page at a time.
  const more = h('button', { hidden: true, id: 'net-older' }, 'Older');
  let next = null;
  const load = async () => {
    const q = new URLSearchParams({ kind: 'net.decision', limit: '500' });
    if (next) q.set('before', String(next));
    const page = await api('GET', `/v1/journal?${q}`);
    entries.push(...page.entries);
    next = page.next_before;
    more.hidden = !next;
    render();
  };
  more.addEventListener('click', act(more, load));
  el.append(h('h1', {}, 'Network'), h('div', { class: 'filters' }, cell, verdict, host),
    h('table', {}, h('thead', {}, h('tr', {}, ['time', 'cell', 'verdict', 'destination', 'kind', 'method', 'path', 'rule', 'reason', 'bytes'].map((t) => h('th', {}, t)))), list), more);
  load().catch((e) => toast(e.message, true));
  onEntry((e) => { if (e.kind === 'net.decision') { entries.unshift(e); render(); } });
}

// ---------- approvals ----------

function viewApprovals(el) {
  el.append(h('h1', {}, 'Approvals'), h('div', { id: 'approvals' }));
  renderApprovals();
}

// The questions in the order the table last showed them.
let approvalsShown = [];
// How long a row that came or moved cannot be approved: a click meant for the row that was
// under the pointer (one that went: answered elsewhere, or timed out at a moment its cell can
// foresee) would otherwise approve the one that took its place.
const SETTLE_MS = 1000;

function renderApprovals() {
  const box = $('#approvals');
  if (!box) return;
  const before = approvalsShown;
  approvalsShown = state.approvals.map((a) => a.id);
  if (state.approvals.length === 0) { box.replaceChildren(h('p', { class: 'muted' }, 'Nothing waits for an answer.')); return; }
  box.replaceChildren(h('table', {}, h('thead', {}, h('tr', {}, ['cell', 'asks', 'rule', 'waiting', 'scope', ''].map((t) => h('th', {}, t)))),
    h('tbody', {}, state.approvals.map((a, i) => {
      const scope = h('select', {}, h('option', { value: 'once' }, 'this once'), h('option', { value: 'cell' }, 'for this cell'), h('option', { value: 'always' }, 'for every cell'));
      const answer = (decision) => async () => {
        await api('POST', `/v1/approvals/${enc(a.cell)}/${a.id}`, { decision, scope: scope.value });
        await loadApprovals();
      };
      return h('tr', { dataset: { approval: a.id } }, h('td', {}, a.cell), h('td', { class: 'mono' }, a.request), h('td', { class: 'mono' }, a.rule),
        h('td', {}, age(a.asked_at)), h('td', {}, scope),
        h('td', { class: 'actions' }, settled(button('Approve', answer('approve'), { class: 'primary', dataset: { act: 'approve' } }), before[i] === a.id), button('Deny', answer('deny'), { class: 'danger', dataset: { act: 'deny' } })));
    }))));
}

// An Approve button that waits SETTLE_MS unless its row is where it was.
function settled(b, stayed) {
  if (stayed) return b;
  b.disabled = true;
  b.title = 'this row just came or moved here: wait a moment';
  setTimeout(() => { b.disabled = false; b.title = ''; }, SETTLE_MS);
  return b;
}

// ---------- agents ----------

async function viewAgents(el) {
  const box = h('div', { id: 'agents' });
  el.append(h('h1', {}, 'Agent sessions'), box);
  const load = async () => {
    const list = await api('GET', '/v1/agents');
    box.replaceChildren(list.length === 0 ? h('p', { class: 'muted' }, 'No sessions. `warden agent run TASK` starts one.') : h('table', {},
      h('thead', {}, h('tr', {}, ['session', 'state', 'model', 'turn', 'tokens in/out', 'cell', 'started'].map((t) => h('th', {}, t)))),
      h('tbody', {}, list.map((a) => h('tr', {}, h('td', {}, h('a', { href: `#/agent/${enc(a.id)}` }, a.id)),
        h('td', {}, h('span', { class: `state ${a.state}` }, a.state)), h('td', {}, a.model), h('td', {}, a.turn),
        h('td', {}, `${a.usage.input} / ${a.usage.output}`), h('td', {}, h('a', { href: `#/cell/${enc(a.cell)}` }, a.cell)), h('td', {}, age(a.started_ms)))))));
  };
  state.refresh = load;
  await load().catch((e) => toast(e.message, true));
}

async function viewAgent(el, id) {
  const path = `/v1/agents/${enc(id)}`;
  const head = h('div', { class: 'panel' });
  const convo = h('div', { id: 'conversation' });
  const say = h('input', { placeholder: 'an instruction for the next turn', style: 'flex:1', id: 'say' });
  el.append(h('h1', {}, h('a', { href: '#/agents' }, 'Agents'), ' / ', id), head,
    h('div', { class: 'filters' }, say, button('Say', async () => { await api('POST', `${path}/say`, { text: say.value }); say.value = ''; }, { dataset: { act: 'say' } })),
    convo);
  const load = async () => {
    const [info, transcript] = await Promise.all([api('GET', path), api('GET', `${path}/transcript`)]);
    head.replaceChildren(
      h('div', {}, h('span', { class: `state ${info.state}`, id: 'agent-state' }, info.state), ` · ${info.model} · turn ${info.turn} · tokens ${info.usage.input} in, ${info.usage.output} out · cell `, h('a', { href: `#/cell/${enc(info.cell)}` }, info.cell),
        info.forked_from ? ` · forked from ${info.forked_from}` : ''),
      info.summary ? h('p', {}, info.summary) : '', info.ended ? h('p', { class: 'muted' }, info.ended) : '',
      h('div', { class: 'actions', style: 'margin-top:.5rem' },
        button('Pause', () => api('POST', `${path}/pause`), { dataset: { act: 'pause' } }),
        button('Resume', () => api('POST', `${path}/resume`), { dataset: { act: 'resume' } }),
        button('Step', () => api('POST', `${path}/step`), { dataset: { act: 'step' } }),
        button('Stop', () => api('POST', `${path}/stop`), { class: 'danger', dataset: { act: 'stop' } })));
    // Items grouped by the turn they were in: each assistant item starts one.
    const turnOf = [];
    let t = 0;
    for (const item of transcript.items) { if (item.type === 'assistant') t += 1; turnOf.push(t); }
    const results = new Map();
    for (const item of transcript.items) if (item.type === 'result') results.set(item.call_id, item);
    const out = [h('div', { class: 'turn user' }, h('div', { class: 'who' }, 'instructions'), h('pre', {}, transcript.instructions))];
    transcript.items.forEach((item, i) => {
      if (item.type === 'user') {
        const operator = item.text.startsWith('[operator]') || i > 0;
        out.push(h('div', { class: `turn ${operator ? 'operator' : 'user'}` }, h('div', { class: 'who' }, i === 0 ? 'task' : 'operator'), h('pre', {}, item.text)));
      } else if (item.type === 'assistant') {
        const n = turnOf[i];
        out.push(h('div', { class: 'turn assistant', dataset: { turn: n } },
          h('div', { class: 'who' }, `turn ${n} · model `,
            button('Rewind here', async () => { if (confirm(`Rewind ${id} to turn ${n}? The workspace goes back with it.`)) await api('POST', `${path}/rewind`, { turn: n }); }, { class: 'quiet', dataset: { act: 'rewind' } }),
            button('Fork here', async () => { const f = await api('POST', `${path}/fork`, { turn: n, paused: true }); location.hash = `#/agent/${enc(f.id)}`; }, { class: 'quiet', dataset: { act: 'fork' } })),
          item.text ? h('pre', {}, item.text) : '',
          item.calls.map((c) => {
            const r = results.get(c.id);
            return h('div', { class: 'turn result' }, h('div', { class: 'who' }, `tool ${c.name}`), h('pre', { class: 'muted' }, c.arguments),
              r ? h('pre', { class: r.error ? 'error' : '' }, r.output) : h('div', { class: 'muted' }, 'waiting…'));
          })));
      }
    });
    convo.replaceChildren(...out);
  };
  state.refresh = load;
  await load().catch((e) => toast(e.message, true));
}

// ---------- start ----------

document.addEventListener('DOMContentLoaded', () => {
  $('#login-form').addEventListener('submit', (ev) => { ev.preventDefault(); logIn($('#token').value); });
  $('#logout').addEventListener('click', async () => { await api('POST', '/ui/logout').catch(() => {}); keepCsrf(''); if (state.events) state.events.close(); showLogin(); });
  // `warden dashboard` links here with the token after `#token=`: it is read, traded for a
  // session and wiped from the address bar (a fragment never reaches the server or its logs),
  // whether the page loads with it or is already open.
  const takeToken = () => {
    const m = location.hash.match(/(?:^#|&)token=([^&]+)/);
    if (!m) return false;
    history.replaceState(null, '', `${location.pathname}#/cells`);
    logIn(decodeURIComponent(m[1]));
    return true;
  };
  window.addEventListener('hashchange', () => { if (!takeToken()) route(); });
  if (!takeToken()) start();
});
