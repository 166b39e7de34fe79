// Kernelgate's browser console. Plain JavaScript, no dependencies, nothing loaded from
// elsewhere. It is a client of the gateway's own API: REST for kernels, and the channels
// WebSocket in the legacy JSON encoding (one text frame per message, no subprotocol).
//
// Kernel output is untrusted. Text goes into the page through textContent only; images are
// data: URLs (an SVG shown through <img> cannot run scripts); HTML goes into an <iframe>
// sandboxed without allow-scripts. The page's Content-Security-Policy backs all of this.
'use strict';

(function () {
  const TOKEN_KEY = 'kernelgate.token';
  const KERNEL_KEY = 'kernelgate.kernel';
  const POLL_MS = 10000;
  const APPROVALS_POLL_MS = 2000;
  const KERNEL_STATES = new Set(['starting', 'idle', 'busy', 'restarting', 'dead']);
  const MAX_STREAM_CHARS = 1 << 20; // per output block; older text is dropped beyond it
  // Jupyter's order of preference when one output offers several formats.
  const MIME_ORDER = [
    'text/html', 'image/svg+xml', 'image/png', 'image/jpeg', 'image/gif',
    'application/json', 'text/markdown', 'text/latex', 'text/plain',
  ];

  // ---------------------------------------------------------------- small helpers

  function uuid4() {
    const b = new Uint8Array(16);
    crypto.getRandomValues(b); // randomUUID needs a secure context; this does not
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    const h = Array.from(b, (x) => x.toString(16).padStart(2, '0')).join('');
    return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
  }

  function el(tag, className, text) {
    const e = document.createElement(tag);
    if (className) e.className = className;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  const $ = (id) => document.getElementById(id);

  function utf8ToBase64(s) {
    const bytes = new TextEncoder().encode(s);
    let bin = '';
    for (let i = 0; i < bytes.length; i += 0x8000) {
      bin += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
    }
    return btoa(bin);
  }

  function joinText(v) {
    return Array.isArray(v) ? v.join('') : String(v == null ? '' : v);
  }

  // ---------------------------------------------------------------- ANSI SGR colours

  // JupyterLab's palette, readable on a light background: 8 normal, then 8 bright.
  const ANSI_NAMES = ['black', 'red', 'green', 'yellow', 'blue', 'magenta', 'cyan', 'white'];

  function xterm256(n) {
    if (n < 16) return null; // named colours use classes
    if (n < 232) {
      const levels = [0, 95, 135, 175, 215, 255];
      const i = n - 16;
      return `rgb(${levels[Math.floor(i / 36)]}, ${levels[Math.floor(i / 6) % 6]}, ${levels[i % 6]})`;
    }
    const g = 8 + 10 * (n - 232);
    return `rgb(${g}, ${g}, ${g})`;
  }

  // A colour is {index: 0..255} or {rgb: 'rgb(...)'}; null is the default.
  function applySgr(st, params) {
    const p = params.length ? params : [0];
    for (let i = 0; i < p.length; i++) {
      const c = p[i];
      if (c === 0) {
        st.fg = st.bg = null;
        st.bold = st.dim = st.italic = st.underline = st.inverse = st.strike = false;
      } else if (c === 1) st.bold = true;
      else if (c === 2) st.dim = true;
      else if (c === 3) st.italic = true;
      else if (c === 4) st.underline = true;
      else if (c === 7) st.inverse = true;
      else if (c === 9) st.strike = true;
      else if (c === 21 || c === 22) st.bold = st.dim = false;
      else if (c === 23) st.italic = false;
      else if (c === 24) st.underline = false;
      else if (c === 27) st.inverse = false;
      else if (c === 29) st.strike = false;
      else if (c >= 30 && c <= 37) st.fg = { index: c - 30 };
      else if (c === 39) st.fg = null;
      else if (c >= 40 && c <= 47) st.bg = { index: c - 40 };
      else if (c === 49) st.bg = null;
      else if (c >= 90 && c <= 97) st.fg = { index: c - 90 + 8 };
      else if (c >= 100 && c <= 107) st.bg = { index: c - 100 + 8 };
      else if (c === 38 || c === 48) {
        let colour = null;
        if (p[i + 1] === 5 && i + 2 < p.length) {
          colour = { index: Math.min(255, Math.max(0, p[i + 2])) };
          i += 2;
        } else if (p[i + 1] === 2 && i + 4 < p.length) {
          const [r, g, b] = [p[i + 2], p[i + 3], p[i + 4]].map((v) => Math.min(255, Math.max(0, v)));
          colour = { rgb: `rgb(${r}, ${g}, ${b})` };
          i += 4;
        } else {
          break; // malformed: ignore the rest of this sequence
        }
        if (c === 38) st.fg = colour;
        else st.bg = colour;
      }
    }
  }

  // Splits text with ANSI escape sequences into styled segments. SGR sequences set the
  // style; every other escape sequence (cursor moves, OSC titles...) is dropped.
  function ansiSegments(text) {
    const re = /\x1b\[([0-?]*)[ -/]*([@-~])|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]?/g;
    const st = { fg: null, bg: null, bold: false, dim: false, italic: false, underline: false, inverse: false, strike: false };
    const out = [];
    let last = 0;
    let m;
    const push = (s) => { if (s) out.push(Object.assign({ text: s }, st)); };
    while ((m = re.exec(text)) !== null) {
      push(text.slice(last, m.index));
      last = re.lastIndex;
      if (m[2] === 'm') {
        const params = m[1] === '' ? [] : m[1].split(/[;:]/).map((x) => (x === '' ? 0 : parseInt(x, 10) || 0));
        applySgr(st, params);
      }
    }
    push(text.slice(last));
    return out;
  }

  function colourTo(span, colour, which) {
    if (!colour) return;
    if (colour.index !== undefined && colour.index < 16) {
      const bright = colour.index >= 8 ? 'bright-' : '';
      span.classList.add(`ansi-${which}-${bright}${ANSI_NAMES[colour.index % 8]}`);
    } else {
      span.style[which === 'fg' ? 'color' : 'backgroundColor'] = colour.rgb || xterm256(colour.index);
    }
  }

  // Appends ANSI-coloured text to `parent` as text nodes and spans: nothing is ever parsed
  // as HTML, so the text needs no escaping.
  function renderAnsi(parent, text) {
    for (const seg of ansiSegments(text)) {
      let { fg, bg } = seg;
      if (seg.inverse) [fg, bg] = [bg || { index: 0 }, fg || { index: 7 }];
      const plain = !fg && !bg && !seg.bold && !seg.dim && !seg.italic && !seg.underline && !seg.strike;
      if (plain) {
        parent.appendChild(document.createTextNode(seg.text));
        continue;
      }
      const span = el('span', '', seg.text);
      colourTo(span, fg, 'fg');
      colourTo(span, bg, 'bg');
      if (seg.bold) span.classList.add('ansi-bold');
      if (seg.dim) span.classList.add('ansi-dim');
      if (seg.italic) span.classList.add('ansi-italic');
      if (seg.underline) span.classList.add('ansi-underline');
      if (seg.strike) span.classList.add('ansi-strike');
      parent.appendChild(span);
    }
  }

  // What a terminal shows for text with carriage returns (progress bars): a line's text
  // after its last \r wins.
  function foldCarriageReturns(text) {
    if (text.indexOf('\r') < 0) return text;
    return text.replace(/\r+\n/g, '\n').split('\n').map((line) => {
      const i = line.lastIndexOf('\r');
      return i < 0 ? line : line.slice(i + 1);
    }).join('\n');
  }

  // ---------------------------------------------------------------- rich outputs

  const FRAME_STYLE = `
    html { font: 13px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; color: #1f2328; }
    body { margin: 0; padding: 2px; }
    table { border-collapse: collapse; border: none; font-size: 12.5px; font-variant-numeric: tabular-nums; }
    th, td { padding: 4px 10px; text-align: right; border: none; white-space: nowrap; }
    thead th { border-bottom: 1px solid #8c959f; font-weight: 600; vertical-align: bottom; }
    tbody tr:nth-child(odd) { background: #f6f8fa; }
    tbody tr:hover { background: #ddf4ff; }
    tbody th { font-weight: 600; }
  `;

  function htmlFrame(html) {
    const frame = el('iframe', 'html-output');
    // No allow-scripts: nothing in the output runs. allow-same-origin only lets this page
    // read the frame's height to size it; without scripts the frame can do nothing with it.
    frame.setAttribute('sandbox', 'allow-same-origin');
    frame.setAttribute('referrerpolicy', 'no-referrer');
    frame.title = 'HTML output';
    const fit = () => {
      try {
        const doc = frame.contentDocument;
        if (!doc || !doc.documentElement) return;
        // The root element's box is the content's height (scrollHeight would be at least
        // the frame's current height, so the frame could never shrink).
        const h = Math.ceil(doc.documentElement.getBoundingClientRect().height);
        const scrollbar = doc.documentElement.scrollWidth > frame.clientWidth ? 16 : 0;
        frame.style.height = `${Math.min(Math.max(h + scrollbar, 24), 600)}px`;
      } catch (_) {
        /* cross-origin: keep the default height */
      }
    };
    frame.addEventListener('load', fit);
    window.addEventListener('resize', fit);
    frame.srcdoc = `<!doctype html><html><head><meta charset="utf-8"><style>${FRAME_STYLE}</style></head><body>${html}</body></html>`;
    return frame;
  }

  function image(mime, b64, meta) {
    const img = el('img', 'image-output');
    img.alt = `${mime} output`;
    img.src = `data:${mime};base64,${b64.replace(/\s+/g, '')}`;
    if (meta && typeof meta.width === 'number') img.width = meta.width;
    if (meta && typeof meta.height === 'number') img.height = meta.height;
    return img;
  }

  // A widget display (ipywidgets) as text, the same the agent API and MCP give
  // (protocol/src/widget.rs, docs/widgets.md): the console has no widget manager.
  const WIDGET_MIME = 'application/vnd.jupyter.widget-view+json';
  function widgetText(data) {
    const view = data[WIDGET_MIME];
    if (!view || typeof view !== 'object' || Array.isArray(view)) return null;
    const repr = data['text/plain'] === undefined ? '' : joinText(data['text/plain']).trim();
    const what = repr || `model ${view.model_id || ''}`;
    return `[interactive widget ${what} — interactive in JupyterLab; here it is shown as text]`;
  }

  // One output block for a display_data / execute_result bundle.
  function renderBundle(data, metadata) {
    const widget = widgetText(data);
    if (widget !== null) {
      const box = el('div', 'output-rich');
      box.dataset.mime = WIDGET_MIME;
      box.appendChild(el('pre', 'text-output', widget));
      return box;
    }
    const mime = MIME_ORDER.find((m) => data[m] !== undefined) || Object.keys(data)[0];
    const meta = (metadata && metadata[mime]) || {};
    const box = el('div', 'output-rich');
    if (mime === undefined) return box;
    box.dataset.mime = mime;
    const value = data[mime];
    switch (mime) {
      case 'text/html':
        box.appendChild(htmlFrame(joinText(value)));
        break;
      case 'image/svg+xml':
        // As an <img>, an SVG is a picture only: its scripts never run.
        box.appendChild(image(mime, utf8ToBase64(joinText(value)), meta));
        break;
      case 'image/png':
      case 'image/jpeg':
      case 'image/gif':
        box.appendChild(image(mime, joinText(value), meta));
        break;
      case 'application/json': {
        box.appendChild(el('pre', 'text-output', JSON.stringify(value, null, 2)));
        break;
      }
      default: {
        const pre = el('pre', 'text-output');
        renderAnsi(pre, joinText(value));
        box.appendChild(pre);
      }
    }
    return box;
  }

  // ---------------------------------------------------------------- one run (a cell)

  // The top bar and the prompt are sticky: they cover the page's top and bottom edges, so
  // scrolling an output to the viewport's edge (scrollIntoView) would leave it under the
  // prompt. This scrolls the page so that a node ending below the prompt's top ends just above
  // it (a terminal showing its newest line), and a node starting under the top bar starts
  // just below it.
  function reveal(node) {
    if (!node || !node.isConnected) return;
    const bar = document.querySelector('.topbar');
    const prompt = document.querySelector('.prompt');
    const r = node.getBoundingClientRect();
    const top = (bar ? bar.getBoundingClientRect().bottom : 0) + 8;
    const bottom = Math.min(window.innerHeight, prompt ? prompt.getBoundingClientRect().top : window.innerHeight) - 8;
    if (r.bottom > bottom) {
      window.scrollBy(0, r.bottom - bottom);
    } else if (r.top < top) {
      window.scrollBy(0, r.top - top);
    }
  }

  class Run {
    constructor(code, log) {
      this.msgId = uuid4();
      this.started = performance.now();
      this.done = false;
      this.root = el('article', 'run running');
      this.root.dataset.msgId = this.msgId;
      const input = el('div', 'run-input');
      this.label = el('div', 'prompt-label', 'In [*]:');
      input.appendChild(this.label);
      input.appendChild(el('pre', 'code', code));
      this.meta = el('div', 'run-meta', 'queued');
      this.outputs = el('div', 'run-outputs');
      this.root.append(input, this.outputs, this.meta);
      this.lastStream = null;
      this.clearPending = false;
      log.appendChild(this.root);
    }

    setCount(n) {
      if (typeof n === 'number') this.label.textContent = `In [${n}]:`;
    }

    add(node) {
      if (this.clearPending) {
        this.outputs.replaceChildren();
        this.clearPending = false;
      }
      this.outputs.appendChild(node);
      this.lastStream = null;
      reveal(node);
      // Images and HTML frames take their height when they load: reveal the end again then,
      // if this is still the newest output.
      const media = node.matches('img, iframe') ? [node] : [...node.querySelectorAll('img, iframe')];
      for (const m of media) {
        m.addEventListener('load', () => {
          if (this.outputs.lastElementChild === node) reveal(node);
        });
      }
    }

    stream(name, text) {
      if (this.clearPending) {
        this.outputs.replaceChildren();
        this.clearPending = false;
        this.lastStream = null;
      }
      if (!this.lastStream || this.lastStream.name !== name) {
        const pre = el('pre', `stream stream-${name === 'stderr' ? 'stderr' : 'stdout'}`);
        this.outputs.appendChild(pre);
        this.lastStream = { name, pre, text: '' };
      }
      const s = this.lastStream;
      s.text += text;
      if (s.text.length > MAX_STREAM_CHARS) {
        s.text = `[... earlier output dropped ...]\n${s.text.slice(-MAX_STREAM_CHARS)}`;
      }
      s.pre.replaceChildren();
      renderAnsi(s.pre, foldCarriageReturns(s.text));
      reveal(s.pre);
    }

    display(content, isResult) {
      const box = renderBundle(content.data || {}, content.metadata || {});
      if (isResult) {
        box.classList.add('execute-result');
        this.setCount(content.execution_count);
        const out = el('div', 'out-label', `Out[${content.execution_count}]:`);
        const wrap = el('div', 'output-with-label');
        wrap.append(out, box);
        this.add(wrap);
      } else {
        this.add(box);
      }
      return box;
    }

    error(content) {
      const pre = el('pre', 'error-output');
      const tb = Array.isArray(content.traceback) && content.traceback.length
        ? content.traceback.join('\n')
        : `${content.ename}: ${content.evalue}`;
      renderAnsi(pre, tb);
      this.add(pre);
      this.root.classList.add('failed');
    }

    clear(wait) {
      if (wait) this.clearPending = true;
      else {
        this.outputs.replaceChildren();
        this.lastStream = null;
      }
    }

    finish(status, count) {
      if (this.done) return;
      this.done = true;
      this.setCount(count);
      if (count == null && this.label.textContent === 'In [*]:') this.label.textContent = 'In [ ]:';
      this.root.classList.remove('running');
      this.root.classList.add(`status-${status}`);
      const secs = ((performance.now() - this.started) / 1000).toFixed(2);
      const words = { ok: `done in ${secs} s`, error: `failed after ${secs} s`, aborted: 'aborted (an earlier run failed)' };
      this.meta.textContent = words[status] || status;
      if (this.root.parentElement && this.root.parentElement.lastElementChild === this.root) reveal(this.meta);
    }

    abandon(reason) {
      if (this.done) return;
      this.done = true;
      this.root.classList.remove('running');
      this.root.classList.add('status-lost');
      this.label.textContent = 'In [ ]:';
      this.meta.textContent = reason;
    }
  }

  // ---------------------------------------------------------------- the page

  const sessionId = uuid4(); // one Jupyter session per page load
  const ui = {
    tokenForm: $('token-form'), token: $('token'), kernelBar: $('kernel-bar'),
    select: $('kernel-select'), newKernel: $('new-kernel'), status: $('kernel-status'),
    statusText: $('kernel-status-text'), interrupt: $('interrupt'), restart: $('restart'),
    logout: $('disconnect'), notice: $('notice'), log: $('log'), code: $('code'), run: $('run'),
    approvals: $('approvals'), approvalList: $('approval-list'),
  };
  const app = {
    token: sessionStorage.getItem(TOKEN_KEY) || '',
    kernelId: null,
    ws: null,
    socketGen: 0,
    backoff: 1000,
    reconnectTimer: null,
    pollTimer: null,
    approvalsTimer: null,
    runs: new Map(),
    displays: new Map(), // display_id -> [box] for update_display_data
    history: [],
    historyPos: 0,
    restarting: false, // a restart request is under way
  };

  function notice(text, kind) {
    if (!text) {
      ui.notice.hidden = true;
      return;
    }
    ui.notice.textContent = text;
    ui.notice.className = `notice notice-${kind || 'info'}`;
    ui.notice.hidden = false;
  }

  function setStatus(state) {
    ui.status.className = `status status-${state}`;
    ui.statusText.textContent = state;
    ui.status.dataset.state = state;
    // Keep the picker's entry for this kernel in step with the live state.
    const opt = app.kernelId && Array.from(ui.select.options).find((o) => o.value === app.kernelId);
    if (opt && opt.dataset.name && KERNEL_STATES.has(state)) opt.textContent = kernelLabel({ id: app.kernelId, name: opt.dataset.name, execution_state: state });
    const usable = app.kernelId && app.ws && app.ws.readyState === WebSocket.OPEN;
    ui.code.disabled = !app.kernelId;
    ui.code.placeholder = app.kernelId
      ? 'Type Python code here. Shift+Enter runs it.'
      : 'Connect with the token, pick or start a kernel, then type code here. Shift+Enter runs.';
    ui.run.disabled = !usable;
    ui.interrupt.disabled = !app.kernelId || state === 'dead' || state === 'gone';
    ui.restart.disabled = !app.kernelId || state === 'gone' || app.restarting;
  }

  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  async function api(method, path, body) {
    const init = { method, headers: { Authorization: `token ${app.token}` }, cache: 'no-store' };
    if (body !== undefined) {
      init.headers['Content-Type'] = 'application/json';
      init.body = JSON.stringify(body);
    }
    let resp;
    try {
      resp = await fetch(path, init);
    } catch (e) {
      throw new ApiError(0, `cannot reach the gateway (${e.message})`);
    }
    const text = await resp.text();
    let json = null;
    try {
      json = text ? JSON.parse(text) : null;
    } catch (_) {
      /* not JSON */
    }
    if (!resp.ok) {
      const msg = (json && (json.message || json.reason)) || text || resp.statusText;
      throw new ApiError(resp.status, `${resp.status}: ${msg}`);
    }
    return json;
  }

  // ------------------------------------------------ token and kernel list

  async function connect(token) {
    app.token = token;
    notice('');
    try {
      const kernels = await api('GET', '/api/kernels');
      sessionStorage.setItem(TOKEN_KEY, token);
      ui.tokenForm.hidden = true;
      ui.kernelBar.hidden = false;
      fillKernels(kernels);
      const wanted = sessionStorage.getItem(KERNEL_KEY);
      const pick = kernels.find((k) => k.id === wanted) || kernels[0];
      if (pick) attach(pick.id);
      else {
        setStatus('no kernel');
        notice('No kernel is running. Press "New kernel" to start one.');
      }
      clearInterval(app.pollTimer);
      app.pollTimer = setInterval(poll, POLL_MS);
      watchApprovals();
    } catch (e) {
      sessionStorage.removeItem(TOKEN_KEY);
      app.token = '';
      ui.tokenForm.hidden = false;
      ui.kernelBar.hidden = true;
      const why = e.status === 401 || e.status === 403 ? 'The gateway rejected this token.' : `Could not list kernels: ${e.message}`;
      notice(why, 'error');
      ui.token.focus();
    }
  }

  function kernelLabel(k) {
    return `${k.name || 'kernel'} · ${k.id.slice(0, 8)} · ${k.execution_state}`;
  }

  function fillKernels(kernels) {
    const keep = app.kernelId;
    ui.select.replaceChildren();
    const none = el('option', '', kernels.length ? '— pick a kernel —' : '— no kernels —');
    none.value = '';
    ui.select.appendChild(none);
    for (const k of kernels) {
      const live = k.id === keep && KERNEL_STATES.has(ui.status.dataset.state) && ui.status.dataset.state;
      const o = el('option', '', kernelLabel(live ? Object.assign({}, k, { execution_state: live }) : k));
      o.value = k.id;
      o.dataset.name = k.name || 'kernel';
      ui.select.appendChild(o);
    }
    if (keep && !kernels.some((k) => k.id === keep)) {
      const o = el('option', '', `${keep.slice(0, 8)} · gone`);
      o.value = keep;
      ui.select.appendChild(o);
    }
    ui.select.value = keep || '';
  }

  async function poll() {
    if (!app.token) return;
    try {
      const kernels = await api('GET', '/api/kernels');
      fillKernels(kernels);
      if (app.kernelId && !kernels.some((k) => k.id === app.kernelId)) kernelGone();
    } catch (e) {
      if (e.status === 401 || e.status === 403) logout('The gateway no longer accepts this token.');
    }
  }

  async function newKernel() {
    ui.newKernel.disabled = true;
    notice('Starting a kernel…');
    try {
      const k = await api('POST', '/api/kernels', {});
      notice('');
      fillKernels(await api('GET', '/api/kernels'));
      attach(k.id);
    } catch (e) {
      notice(`Could not start a kernel: ${e.message}`, 'error');
    } finally {
      ui.newKernel.disabled = false;
    }
  }

  // ------------------------------------------------ approvals (admin keys)

  // Admin keys see the executions the policy holds and answer them here. Other keys get
  // 403 and the panel stays hidden.
  function watchApprovals() {
    clearInterval(app.approvalsTimer);
    app.approvalsTimer = setInterval(refreshApprovals, APPROVALS_POLL_MS);
    refreshApprovals();
  }

  async function refreshApprovals() {
    if (!app.token) return;
    let pending;
    try {
      pending = await api('GET', '/api/kernelgate/approvals');
    } catch (e) {
      if (e.status === 403 || e.status === 404) {
        clearInterval(app.approvalsTimer);
        ui.approvals.hidden = true;
      }
      return;
    }
    showApprovals(Array.isArray(pending) ? pending : []);
  }

  function showApprovals(pending) {
    ui.approvals.hidden = pending.length === 0;
    const shown = new Set(pending.map((a) => a.id));
    for (const li of Array.from(ui.approvalList.children)) {
      if (!shown.has(li.dataset.approvalId)) li.remove();
    }
    for (const a of pending) {
      if (ui.approvalList.querySelector(`[data-approval-id="${CSS.escape(a.id)}"]`)) continue;
      const li = el('li', 'approval');
      li.dataset.approvalId = a.id;
      li.appendChild(el('div', 'approval-meta',
        `key ${a.key} · kernel ${String(a.kernel_id).slice(0, 8)} · asked ${a.requested_at}`));
      li.appendChild(el('div', 'approval-reason', a.reason));
      li.appendChild(el('pre', 'approval-code', a.code));
      const actions = el('div', 'approval-actions');
      const yes = el('button', 'primary approve', 'Approve');
      const no = el('button', 'deny', 'Deny');
      yes.type = no.type = 'button';
      yes.addEventListener('click', () => answerApproval(a.id, true, li));
      no.addEventListener('click', () => answerApproval(a.id, false, li));
      actions.append(yes, no);
      li.appendChild(actions);
      ui.approvalList.appendChild(li);
    }
  }

  async function answerApproval(id, approve, li) {
    for (const b of li.querySelectorAll('button')) b.disabled = true;
    try {
      await api('POST', `/api/kernelgate/approvals/${encodeURIComponent(id)}`, { approve });
      notice(approve ? 'Approved: the code runs now.' : 'Denied: the code will not run.');
      setTimeout(() => notice(''), 3000);
    } catch (e) {
      notice(`Could not answer: ${e.message}`, 'error');
    }
    li.remove();
    refreshApprovals();
  }

  function logout(reason) {
    detach();
    clearInterval(app.approvalsTimer);
    ui.approvals.hidden = true;
    clearInterval(app.pollTimer);
    sessionStorage.removeItem(TOKEN_KEY);
    app.token = '';
    ui.token.value = '';
    ui.kernelBar.hidden = true;
    ui.tokenForm.hidden = false;
    setStatus('unknown');
    ui.statusText.textContent = 'no kernel';
    notice(reason || '', reason ? 'error' : 'info');
  }

  // ------------------------------------------------ the channels WebSocket

  function detach() {
    app.socketGen += 1;
    clearTimeout(app.reconnectTimer);
    if (app.ws) {
      app.ws.onclose = null;
      app.ws.close();
    }
    app.ws = null;
    for (const run of app.runs.values()) run.abandon('no reply: the page left this kernel');
    app.runs.clear();
    app.displays.clear();
    app.kernelId = null;
  }

  function attach(id) {
    if (app.kernelId === id && app.ws) return;
    detach();
    app.kernelId = id;
    sessionStorage.setItem(KERNEL_KEY, id);
    ui.select.value = id;
    const sep = el('div', 'kernel-divider', `kernel ${id}`);
    ui.log.appendChild(sep);
    setStatus('connecting');
    app.backoff = 1000;
    openSocket();
  }

  function openSocket() {
    const gen = app.socketGen;
    const scheme = location.protocol === 'https:' ? 'wss' : 'ws';
    const url = `${scheme}://${location.host}/api/kernels/${encodeURIComponent(app.kernelId)}/channels` +
      `?session_id=${encodeURIComponent(sessionId)}&token=${encodeURIComponent(app.token)}`;
    const ws = new WebSocket(url);
    app.ws = ws;
    ws.onopen = () => {
      if (gen !== app.socketGen) return;
      app.backoff = 1000;
      notice('');
      setStatus(ui.status.dataset.state === 'connecting' ? 'connected' : ui.status.dataset.state);
      send('shell', 'kernel_info_request', {});
    };
    ws.onmessage = (ev) => {
      if (gen !== app.socketGen) return;
      let msg;
      try {
        msg = JSON.parse(ev.data);
      } catch (_) {
        return; // not the legacy encoding: ignore
      }
      onMessage(msg);
    };
    ws.onclose = () => {
      if (gen !== app.socketGen) return;
      app.ws = null;
      setStatus('disconnected');
      scheduleReconnect(gen);
    };
  }

  async function scheduleReconnect(gen) {
    // The kernel may be gone (shut down, culled): then there is nothing to reconnect to.
    try {
      await api('GET', `/api/kernels/${encodeURIComponent(app.kernelId)}`);
    } catch (e) {
      if (gen !== app.socketGen) return;
      if (e.status === 404) return kernelGone();
      if (e.status === 401 || e.status === 403) return logout('The gateway no longer accepts this token.');
    }
    if (gen !== app.socketGen) return;
    const wait = app.backoff;
    app.backoff = Math.min(app.backoff * 2, 30000);
    notice(`Connection to the kernel lost; reconnecting in ${Math.round(wait / 1000)} s…`, 'error');
    app.reconnectTimer = setTimeout(() => {
      if (gen === app.socketGen) openSocket();
    }, wait);
  }

  function kernelGone() {
    const id = app.kernelId;
    app.socketGen += 1;
    if (app.ws) {
      app.ws.onclose = null;
      app.ws.close();
      app.ws = null;
    }
    for (const run of app.runs.values()) run.abandon('no reply: the kernel is gone');
    setStatus('gone');
    ui.run.disabled = true;
    notice(`Kernel ${id ? id.slice(0, 8) : ''} no longer exists (shut down or culled). Pick another or start a new one.`, 'error');
  }

  function send(channel, msgType, content) {
    const msgId = uuid4();
    const msg = {
      header: {
        msg_id: msgId, msg_type: msgType, session: sessionId, username: 'kernelgate-ui',
        date: new Date().toISOString(), version: '5.3',
      },
      parent_header: {}, metadata: {}, content, buffers: [], channel,
    };
    app.ws.send(JSON.stringify(msg));
    return msgId;
  }

  function onMessage(msg) {
    const header = msg.header || {};
    const type = msg.msg_type || header.msg_type;
    const content = msg.content || {};
    const parentId = msg.parent_header && msg.parent_header.msg_id;
    const run = parentId ? app.runs.get(parentId) : undefined;

    if (msg.channel === 'iopub') {
      switch (type) {
        case 'status':
          setStatus(content.execution_state || 'unknown');
          if (content.execution_state === 'restarting' || content.execution_state === 'dead') {
            for (const r of app.runs.values()) r.abandon(`no reply: the kernel is ${content.execution_state}`);
            app.runs.clear();
          }
          break;
        case 'execute_input':
          if (run) {
            run.setCount(content.execution_count);
            run.meta.textContent = 'running…';
          }
          break;
        case 'stream':
          if (run) run.stream(content.name, content.text || '');
          // Held by the execution policy: show the approval at once, not at the next poll.
          if (String(content.text || '').startsWith('[kernelgate] This code waits')) refreshApprovals();
          break;
        case 'display_data':
        case 'execute_result': {
          if (!run) break;
          const box = run.display(content, type === 'execute_result');
          const id = content.transient && content.transient.display_id;
          if (id) {
            if (!app.displays.has(id)) app.displays.set(id, []);
            app.displays.get(id).push(box);
          }
          break;
        }
        case 'update_display_data': {
          const id = content.transient && content.transient.display_id;
          for (const box of app.displays.get(id) || []) {
            const fresh = renderBundle(content.data || {}, content.metadata || {});
            box.replaceChildren(...fresh.childNodes);
          }
          break;
        }
        case 'error':
          if (run) run.error(content);
          break;
        case 'clear_output':
          if (run) run.clear(!!content.wait);
          break;
        default:
          break;
      }
    } else if (msg.channel === 'shell') {
      if (type === 'execute_reply' && run) {
        // Kept in the table: IOPub and shell are separate sockets, so output may still
        // arrive after the reply.
        run.finish(content.status, content.execution_count);
      } else if (type === 'kernel_info_reply') {
        const li = content.language_info || {};
        ui.status.title = `${content.implementation || 'kernel'} ${content.implementation_version || ''} · ${li.name || ''} ${li.version || ''}`.trim();
      }
    }
  }

  // ------------------------------------------------ running code, interrupt, restart

  function runCode() {
    const code = ui.code.value;
    if (!code.trim()) return;
    if (!app.ws || app.ws.readyState !== WebSocket.OPEN) {
      notice('Not connected to a kernel.', 'error');
      return;
    }
    const run = new Run(code, ui.log);
    run.msgId = send('shell', 'execute_request', {
      code, silent: false, store_history: true, user_expressions: {}, allow_stdin: false, stop_on_error: true,
    });
    run.root.dataset.msgId = run.msgId;
    app.runs.set(run.msgId, run);
    app.history.push(code);
    app.historyPos = app.history.length;
    ui.code.value = '';
    autosize();
    reveal(run.root);
  }

  async function interrupt() {
    if (!app.kernelId) return;
    try {
      await api('POST', `/api/kernels/${encodeURIComponent(app.kernelId)}/interrupt`, {});
      notice('Interrupt sent.');
      setTimeout(() => notice(''), 2000);
    } catch (e) {
      notice(`Interrupt failed: ${e.message}`, 'error');
    }
  }

  async function restart() {
    if (!app.kernelId) return;
    app.restarting = true;
    setStatus('restarting');
    for (const r of app.runs.values()) r.abandon('no reply: the kernel was restarted');
    app.runs.clear();
    try {
      await api('POST', `/api/kernels/${encodeURIComponent(app.kernelId)}/restart`, {});
      ui.log.appendChild(el('div', 'kernel-divider', 'kernel restarted: variables were cleared'));
      if (app.ws && app.ws.readyState === WebSocket.OPEN) send('shell', 'kernel_info_request', {});
    } catch (e) {
      notice(`Restart failed: ${e.message}`, 'error');
    } finally {
      app.restarting = false;
      ui.restart.disabled = ui.status.dataset.state === 'gone';
    }
  }

  // ------------------------------------------------ the editor

  function autosize() {
    ui.code.style.height = 'auto';
    ui.code.style.height = `${Math.min(ui.code.scrollHeight + 2, window.innerHeight * 0.5)}px`;
  }

  function onKey(ev) {
    if (ev.key === 'Enter' && ev.shiftKey) {
      ev.preventDefault();
      runCode();
    } else if (ev.key === 'Tab' && !ev.shiftKey && !ev.ctrlKey && !ev.altKey) {
      ev.preventDefault();
      const { selectionStart: a, selectionEnd: b, value } = ui.code;
      ui.code.value = `${value.slice(0, a)}    ${value.slice(b)}`;
      ui.code.selectionStart = ui.code.selectionEnd = a + 4;
    } else if ((ev.key === 'ArrowUp' || ev.key === 'ArrowDown') && ev.ctrlKey) {
      ev.preventDefault();
      const step = ev.key === 'ArrowUp' ? -1 : 1;
      app.historyPos = Math.min(Math.max(app.historyPos + step, 0), app.history.length);
      ui.code.value = app.history[app.historyPos] || '';
      autosize();
    }
  }

  // ------------------------------------------------ wiring

  ui.tokenForm.addEventListener('submit', (ev) => {
    ev.preventDefault();
    const t = ui.token.value.trim();
    if (t) connect(t);
  });
  ui.select.addEventListener('change', () => {
    if (ui.select.value) attach(ui.select.value);
  });
  ui.newKernel.addEventListener('click', newKernel);
  ui.interrupt.addEventListener('click', interrupt);
  ui.restart.addEventListener('click', restart);
  ui.logout.addEventListener('click', () => logout());
  ui.run.addEventListener('click', runCode);
  ui.code.addEventListener('keydown', onKey);
  ui.code.addEventListener('input', autosize);

  // For tests and the curious: the pure parts.
  window.kernelgate = Object.freeze({ ansiSegments, foldCarriageReturns, sessionId });

  // The URL the gateway prints carries the token: take it, then drop it from the address
  // bar, and so from the history and from anything copied or shared from there.
  const fromUrl = new URLSearchParams(location.search).get('token');
  if (fromUrl) {
    app.token = fromUrl;
    history.replaceState(null, '', location.pathname + location.hash);
  }

  setStatus('unknown');
  ui.statusText.textContent = 'no kernel';
  if (app.token) connect(app.token);
  else {
    notice('Enter the gateway\'s token: the one it printed when it started, or its --token.');
    ui.token.focus();
  }
})();
