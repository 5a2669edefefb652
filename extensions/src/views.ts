// The views inside a Workbench tab. Each asks the server extension for one slice at a time and
// renders it with plain DOM/SVG; none holds checkpoint, memory, run or plan logic of its own.
import { Json, WorkbenchError, errorText, requestAPI } from './api';
import { ISeries, asRecords, el, formatBytes, formatValue, gantt, histogram, jsonView, lineChart, table } from './render';

export type Kind = 'checkpoint' | 'memory' | 'run' | 'plan' | 'time';

/** Runs a JupyterLab command (set by the plugin): the views' buttons reuse the context-menu commands. */
let execute: (command: string, args: Record<string, string>) => void = () => undefined;
export function setCommandRunner(run: typeof execute): void {
  execute = run;
}

function commandButton(label: string, command: string, path: string): HTMLButtonElement {
  const b = el('button', 'jp-Button pw-action', label);
  b.addEventListener('click', () => execute(command, { path }));
  return b;
}

/** What the server calls a thing, mapped onto the four views. */
export function viewKind(kind: string | undefined): Kind | null {
  const k = (kind ?? '').toLowerCase();
  if (k === 'time' || /pt\.trace|step_timeline|^profile$/.test(k)) {
    return 'time';
  }
  if (/snapshot|memory|timeline|pickle/.test(k)) {
    return 'memory';
  }
  if (/plan/.test(k) && !/load/.test(k)) {
    return 'plan';
  }
  if (/run|events/.test(k)) {
    return 'run';
  }
  if (/checkpoint|safetensors|dcp|torch|state|index|pt|bin/.test(k)) {
    return 'checkpoint';
  }
  return null;
}

/** The one-line error the tab shows in place of a view. */
export function showError(host: HTMLElement, err: unknown): void {
  host.replaceChildren(el('div', 'pw-error', errorText(err)));
}

function scalars(obj: Json): Record<string, Json> {
  const out: Record<string, Json> = {};
  if (obj && typeof obj === 'object' && !Array.isArray(obj)) {
    for (const [k, v] of Object.entries(obj)) {
      if (v === null || typeof v !== 'object' || (Array.isArray(v) && v.every(x => x === null || typeof x !== 'object'))) {
        out[k] = v;
      }
    }
  }
  return out;
}

function summaryTable(obj: Json, skip: string[] = []): HTMLElement {
  const s = scalars(obj);
  const t = el('table', 'pw-table pw-kv pw-summary');
  for (const [k, v] of Object.entries(s)) {
    if (skip.includes(k)) {
      continue;
    }
    const tr = t.insertRow();
    tr.appendChild(el('th', undefined, k));
    const td = tr.insertCell();
    td.textContent = formatValue(v, k);
    td.dataset.key = k;
  }
  return t;
}

// ---------------------------------------------------------------- checkpoint browser

/** A field's label: the server's (workbench.checkpoint.labels, the notebook browser's words), else its words. */
function ckptLabel(k: string, labels: Json): string {
  const l = labels && typeof labels === 'object' ? labels[k] : undefined;
  return typeof l === 'string' ? l : k.replace(/^n_/, '').replace(/_/g, ' ');
}

/** A number as workbench.checkpoint.labels.format_number prints it: 16,384 · 0.01235 · 1.235e-04. */
export function ckptNumber(v: number): string {
  if (!Number.isFinite(v)) {
    return Number.isNaN(v) ? 'NaN' : v > 0 ? 'inf' : '-inf';
  }
  if (Number.isInteger(v)) {
    return v.toLocaleString('en-US');
  }
  const a = Math.abs(v);
  if (a >= 1e-3 && a < 1e4) {
    const t = String(Number(v.toPrecision(4))); // no trailing zeros: 0.5, not 0.5000
    if (!/e/.test(t)) {
      return t;
    }
  }
  return v.toExponential(3).replace(/e([+-])(\d)$/, 'e$10$2'); // 1.235e-04, as Python writes it
}

function ckptValue(v: Json, k: string): string {
  if (v === null || v === undefined) {
    return '';
  }
  if (typeof v === 'number') {
    return /bytes/.test(k) && Number.isInteger(v) ? formatBytes(v) : ckptNumber(v);
  }
  if (/shape$/.test(k) && Array.isArray(v)) {
    return v.length ? v.join(' × ') : 'scalar';
  }
  if (Array.isArray(v) && v.every(x => x === null || typeof x !== 'object')) {
    return v.join(', ');
  }
  return formatValue(v, k);
}

/** A key/value table of an answer's scalar fields, labelled in words (data-key: the field). */
function ckptSummary(obj: Json, labels: Json, skip: string[] = []): HTMLElement {
  const t = el('table', 'pw-table pw-kv pw-summary');
  for (const [k, v] of Object.entries(scalars(obj))) {
    if (skip.includes(k) || v === null || v === undefined) {
      continue;
    }
    const tr = t.insertRow();
    tr.appendChild(el('th', undefined, ckptLabel(k, labels)));
    const td = tr.insertCell();
    td.textContent = ckptValue(v, k);
    td.dataset.key = k;
    if (typeof v === 'number') {
      td.className = 'pw-num';
      td.style.whiteSpace = 'nowrap';
    }
  }
  return t;
}

/** The key table: every column but the key on one line, and the key breaking after its dots (a dotted name
 * has no spaces), so a narrow pane squeezes the key, never pushes shape, size or shards out of sight
 * (style/index.css: .pw-ckpt-table). */
function ckptTable(
  rows: Record<string, Json>[],
  cols: string[],
  labels: Json,
  onRowClick?: (row: Record<string, Json>, tr: HTMLTableRowElement) => void
): HTMLTableElement {
  return table(rows, cols, onRowClick, [], {
    className: 'pw-table pw-ckpt-table',
    header: c => ckptLabel(c, labels),
    cell: (td, v, c) => {
      if (c !== 'key') {
        td.textContent = ckptValue(v, c);
        return;
      }
      // a dotted name breaks after its dots (<wbr>); within a part only where the part alone is too long
      // (break-word, unlike anywhere, leaves the column's min-content at its longest part)
      String(v ?? '').split(/(?<=\.)/).forEach((part, i) => {
        if (i) {
          td.appendChild(document.createElement('wbr'));
        }
        td.appendChild(document.createTextNode(part));
      });
    }
  });
}

/** A verify, diff or load-dry-run answer as nested tables: the server's labels for its fields (a name the
 * table lacks is data, such as a tensor kind, and shows as it is), numbers as the notebook prints them. */
function ckptJson(value: Json, labels: Json, depth = 0, hint = ''): HTMLElement {
  const name = (k: string) => (labels && typeof labels[k] === 'string' ? labels[k] : k);
  if (value === null || typeof value !== 'object') {
    return el('span', 'pw-scalar', ckptValue(value, hint));
  }
  if (Array.isArray(value)) {
    if (value.length && value.every(v => v && typeof v === 'object' && !Array.isArray(v))) {
      const cols = Array.from(new Set(value.slice(0, 200).flatMap(r => Object.keys(r))));
      const box = el('div');
      box.appendChild(ckptTable(value.slice(0, 200), cols, labels));
      if (value.length > 200) {
        box.appendChild(el('div', 'pw-note', `first 200 of ${value.length} rows`));
      }
      return box;
    }
    if (value.length > 8) { // a list of keys: folded, one a line
      const box = el('details');
      box.append(el('summary', undefined, `${value.length} items`), el('pre', undefined, value.map(String).join('\n')));
      return box;
    }
    return el('span', 'pw-scalar', ckptValue(value, hint));
  }
  const t = el('table', 'pw-table pw-kv');
  for (const [k, v] of Object.entries(value)) {
    const tr = t.insertRow();
    const th = el('th', undefined, name(k));
    th.style.whiteSpace = 'nowrap';
    tr.appendChild(th);
    const td = tr.insertCell();
    const h = /bytes/.test(k) ? k : hint || k; // under a "..._bytes" key every number is a byte count
    td.appendChild(depth < 3 ? ckptJson(v, labels, depth + 1, h) : el('span', undefined, ckptValue(v, h)));
  }
  return t;
}

export class CheckpointView {
  constructor(readonly host: HTMLElement, readonly path: string, readonly info: Json) {}

  private offset = 0;
  private readonly limit = 200;
  private filter = '';
  private kind = '';
  private labels: Json = {};
  // the histogram's scales, kept from one tensor to the next
  private logX = false;
  private logCount = false;

  async render(): Promise<void> {
    this.host.replaceChildren();
    const summary = el('div', 'pw-summary-box');
    const bar = el('div', 'pw-toolbar');
    const filter = el('input', 'pw-filter');
    filter.placeholder = 'filter keys (substring)';
    const kind = el('select', 'pw-kind');
    for (const k of ['', 'model', 'optimizer', 'master', 'rng', 'extra']) {
      const o = el('option', undefined, k || 'all kinds');
      o.value = k;
      kind.appendChild(o);
    }
    const prev = el('button', 'jp-Button pw-prev', '◀');
    const next = el('button', 'jp-Button pw-next', '▶');
    const where = el('span', 'pw-where');
    bar.append(filter, kind, prev, where, next);
    const actions = el('div', 'pw-toolbar pw-actions');
    actions.append(
      commandButton('Verify checkpoint', 'parallel-workbench:verify', this.path),
      commandButton('Compare with…', 'parallel-workbench:diff', this.path),
      commandButton('Will it load into…', 'parallel-workbench:plan-load', this.path)
    );
    const body = el('div', 'pw-split');
    const keys = el('div', 'pw-keys');
    const detail = el('div', 'pw-detail', 'Select a key to see its statistics and histogram.');
    // The key table never narrower than its columns (keys break after dots, nothing else breaks): in a
    // narrow tab the detail moves below it instead of squeezing the table into a side-scrolling box.
    body.style.flexWrap = 'wrap';
    keys.style.minWidth = 'min-content';
    detail.style.flex = '1 1 30%'; // beside the keys while it has 280px (the histogram scales down to fit)
    detail.style.minWidth = '280px';
    body.append(keys, detail);
    const shardMap = el('details', 'pw-shard-map');
    this.host.append(summary, actions, bar, body, shardMap);

    let first = true;
    const load = async () => {
      keys.replaceChildren(el('div', 'pw-note', 'loading…'));
      try {
        const m = await requestAPI('checkpoint/manifest', {
          path: this.path,
          offset: this.offset,
          limit: this.limit,
          filter: this.filter,
          kind: this.kind
        });
        if (first) {
          first = false;
          this.labels = m.labels ?? {};
          summary.replaceChildren(ckptSummary(m.summary ?? this.info, this.labels, ['path']));
          if (m.summary?.bytes_by_kind) {
            summary.appendChild(table([m.summary.bytes_by_kind], undefined, undefined, Object.keys(m.summary.bytes_by_kind)));
          }
          if (Array.isArray(m.shard_map) && m.shard_map.length) {
            shardMap.replaceChildren(
              el('summary', undefined, `shard map: ${m.shard_map.length} files`),
              ckptTable(asRecords(m.shard_map), ['file', 'rank', 'chunks', 'bytes'], this.labels)
            );
          }
        }
        const rows = asRecords(m.rows);
        const total = Number(m.total ?? rows.length);
        where.textContent = `${total ? this.offset + 1 : 0}–${this.offset + rows.length} of ${total}`;
        prev.disabled = this.offset === 0;
        next.disabled = this.offset + rows.length >= total;
        keys.replaceChildren(
          ckptTable(rows, ['key', 'dtype', 'shape', 'kind', 'bytes', 'n_shards'], this.labels, (row, tr) => {
            keys.querySelectorAll('tr.pw-selected').forEach(n => n.classList.remove('pw-selected'));
            tr.classList.add('pw-selected');
            void this.showTensor(detail, row).then(() => {
              if (detail.offsetTop > keys.offsetTop + keys.offsetHeight / 2) {
                detail.scrollIntoView({ block: 'start' }); // below the keys (a narrow tab): bring it in sight
              }
            });
          })
        );
      } catch (err) {
        showError(keys, err);
      }
    };
    let timer: number | undefined;
    filter.addEventListener('input', () => {
      window.clearTimeout(timer);
      timer = window.setTimeout(() => {
        this.filter = filter.value;
        this.offset = 0;
        void load();
      }, 250);
    });
    kind.addEventListener('change', () => {
      this.kind = kind.value;
      this.offset = 0;
      void load();
    });
    prev.addEventListener('click', () => {
      this.offset = Math.max(0, this.offset - this.limit);
      void load();
    });
    next.addEventListener('click', () => {
      this.offset += this.limit;
      void load();
    });
    await load();
  }

  private async showTensor(detail: HTMLElement, row: Record<string, Json>): Promise<void> {
    const key = String(row.key);
    const heading = () => {
      const h = el('h3', 'pw-key', key);
      h.style.overflowWrap = 'anywhere'; // a long dotted name wraps inside the pane
      return h;
    };
    detail.replaceChildren(heading(), el('div', 'pw-note', 'reading…'));
    try {
      const t = await requestAPI('checkpoint/tensor', { path: this.path, key, bins: 64, log: this.logX });
      detail.replaceChildren(heading(), ckptSummary(t, t.labels ?? this.labels, ['path', 'key']));
      const h = t.histogram;
      if (h && Array.isArray(h.counts) && Array.isArray(h.centers)) {
        const chart = el('div', 'pw-histogram');
        const draw = () => chart.replaceChildren(this.histogramOf(h));
        detail.append(this.scaleToggles(detail, row, draw), chart);
        draw();
      }
      if (Array.isArray(row.shards) && row.shards.length) {
        detail.append(
          el('h4', undefined, `shards (${row.n_shards ?? row.shards.length})`),
          ckptTable(asRecords(row.shards), ['file', 'rank', 'offsets', 'lengths'], this.labels)
        );
      }
    } catch (err) {
      detail.replaceChildren(heading(), el('div', 'pw-error', errorText(err)));
    }
  }

  /** log10 |x| asks the server for the histogram over log10 |x| (zeros left out); log count redraws the
   * same bars on a log count axis. */
  private scaleToggles(detail: HTMLElement, row: Record<string, Json>, redraw: () => void): HTMLElement {
    const bar = el('div', 'pw-toolbar pw-scales');
    const box = (cls: string, text: string, title: string, on: boolean, change: (v: boolean) => void) => {
      const label = el('label', 'pw-scale', undefined);
      const input = el('input', cls);
      input.type = 'checkbox';
      input.checked = on;
      input.addEventListener('change', () => change(input.checked));
      label.title = title;
      label.append(input, document.createTextNode(` ${text}`));
      return label;
    };
    bar.append(
      box('pw-log-x', 'log10 |x|', 'histogram of log10 |x| (zeros left out): values spanning decades', this.logX, v => {
        this.logX = v;
        void this.showTensor(detail, row);
      }),
      box('pw-log-count', 'log count', 'counts on a log scale: the sparse bins next to a full one', this.logCount, v => {
        this.logCount = v;
        redraw();
      })
    );
    return bar;
  }

  private histogramOf(h: Json): HTMLElement {
    const centers: number[] = (h.centers ?? []).map(Number);
    if (!centers.length) {
      return el('div', 'pw-note', 'no finite non-zero values to draw');
    }
    const w = Number(h.width ?? 0);
    const edges = [...centers.map((c: number) => c - w / 2), centers[centers.length - 1] + w / 2];
    const log = h.scale && h.scale !== 'linear';
    const left = log && Number(h.excluded) ? ` (${ckptNumber(Number(h.excluded))} zeros left out)` : '';
    // (the key is the heading above: the title says what is counted)
    return histogram(edges, (h.counts ?? []).map(Number), `histogram of ${log ? 'log10 |x|' : 'x'}${left}`, {
      logCount: this.logCount,
      xLabel: log ? 'log10 |x|' : 'x'
    });
  }
}

// ---------------------------------------------------------------- memory timeline: memory.ts

// ---------------------------------------------------------------- run replay

/** The run's RSS column: the process's resident set, never called a peak (issue 28). */
const RSS = 'RSS (resident set)';
const RUN_LABELS: Record<string, string> = {
  peak_mem_bytes: 'peak_mem_bytes (recorded peak)',
  peak_mem_source: 'peak measured by',
  rss_bytes: 'RSS (process resident set, largest at a step end; not a peak of tensor bytes)'
};

export class RunView {
  constructor(readonly host: HTMLElement, readonly path: string, readonly info: Json) {}

  private since = 0;
  private pipelineStep: number | undefined;
  private lastSteps: Json[] = [];
  private errors: Json[] = [];
  private timer: number | undefined;

  dispose(): void {
    window.clearTimeout(this.timer);
  }

  async render(): Promise<void> {
    let r: Json;
    try {
      r = await requestAPI('run/events', {
        path: this.path,
        since: this.since,
        types: 'step,error,checkpoint',
        limit: 5000,
        points: 1000
      });
    } catch (err) {
      showError(this.host, err);
      return;
    }
    const events: Json[] = r.events ?? [];
    this.lastSteps = [...this.lastSteps, ...events.filter(e => e.type === 'step')].slice(-50);
    this.errors.push(...events.filter(e => e.type === 'error'));
    this.since = Number(r.next ?? this.since);
    this.draw(r);
    if (r.status === 'running' && this.host.isConnected) {
      this.timer = window.setTimeout(() => void this.render(), 2000);
    }
  }

  private draw(r: Json): void {
    const series = Object.entries(r.series ?? {}) as [string, Json][];
    const per = (field: string): ISeries[] =>
      series.map(([rank, s]) => ({ name: `rank ${rank}`, x: (s.step ?? []).map(Number), y: (s[field] ?? []).map(Number) }));
    const bar = el('div', 'pw-toolbar');
    const refresh = el('button', 'jp-Button pw-refresh', 'Refresh');
    refresh.addEventListener('click', () => void this.render());
    bar.append(refresh, el('span', 'pw-status', `status: ${r.status ?? 'unknown'}, ${r.total ?? this.since} events`));
    const summary = summaryTable(r.summary ?? {});
    for (const [key, label] of Object.entries(RUN_LABELS)) {
      const td = summary.querySelector(`td[data-key="${key}"]`);
      if (td?.previousElementSibling) {
        td.previousElementSibling.textContent = label;
      }
    }
    this.host.replaceChildren(summary, bar);
    for (const e of this.errors) {
      const lines = String(e.traceback ?? e.message ?? '').trim().split('\n');
      this.host.appendChild(el('div', 'pw-error', `rank ${e.rank}: ${lines[lines.length - 1]}`));
    }
    // JupyterLab's file browser cannot enter a folder named "checkpoints" (jupyter_server routes
    // /api/contents/<path>/checkpoints to its own checkpoints API), so the run view opens them: the server
    // lists the step directories on disk and those the run's checkpoint events name.
    const ckpts: Json[] = Array.isArray(r.checkpoints) ? r.checkpoints : [];
    if (ckpts.length) {
      const row = el('div', 'pw-toolbar pw-checkpoints');
      row.appendChild(el('span', 'pw-note', 'checkpoints:'));
      for (const c of ckpts) {
        const label = c.step === null || c.step === undefined ? String(c.path).split('/').pop() ?? '' : `step ${c.step}`;
        const b = commandButton(c.latest ? `${label} (latest)` : label, 'parallel-workbench:open', String(c.path));
        b.title = String(c.path);
        row.appendChild(b);
      }
      this.host.appendChild(row);
    }
    this.host.append(
      lineChart(per('loss'), { title: 'loss', xLabel: 'step' }),
      lineChart(per('tokens_per_s'), { title: 'throughput (tokens/s)', xLabel: 'step' })
    );
    this.drawMemory(r.summary ?? {});
    if (r.summary?.pipeline) {
      const box = el('div', 'pw-pipeline', 'reading the pipeline schedule…');
      this.host.appendChild(box);
      void this.drawPipeline(box, this.pipelineStep);
    }
    // a step's mem_bytes is the resident set on CPU (RSS, labelled so) and the allocator's peak on CUDA
    const cuda = new Set(asRecords(r.summary?.memory ?? []).filter(m => String(m.device).startsWith('cuda')).map(m => m.rank));
    const steps = this.lastSteps.map(e => ({
      rank: e.rank,
      step: e.step,
      loss: e.loss,
      tokens_per_s: e.tokens_per_s,
      step_time_s: e.step_time_s,
      peak_mem_bytes: e.peak_mem_bytes ?? (cuda.has(e.rank) ? e.mem_bytes : null),
      [RSS]: cuda.has(e.rank) ? null : e.mem_bytes
    }));
    this.host.append(
      el('h4', undefined, 'last steps'),
      table(steps, ['rank', 'step', 'loss', 'tokens_per_s', 'step_time_s', 'peak_mem_bytes', RSS], undefined, ['peak_mem_bytes', RSS])
    );
  }

  /** The recorded peak per rank and per pipeline stage (one meaning of "peak": the tensor bytes the run
   * recorded), and the resident set beside it, labelled RSS. */
  private drawMemory(summary: Json): void {
    const rows = asRecords(summary.memory ?? []);
    if (!rows.length) {
      return;
    }
    const box = el('div', 'pw-run-memory');
    const ranks = rows.map(m => ({
      rank: m.rank,
      stages: Array.isArray(m.stages) ? m.stages.join(', ') : '',
      device: m.device,
      peak_mem_bytes: m.peak_mem_bytes,
      'at step': m.peak_step,
      [RSS]: m.rss_bytes,
      'peak measured by': m.peak_source ?? 'nothing: run with --memory (or pp > 1) to record tensor bytes'
    }));
    box.append(
      el('h4', undefined, 'memory per rank: recorded peak (peak_mem_bytes) and RSS'),
      table(ranks, ['rank', 'stages', 'device', 'peak_mem_bytes', 'at step', RSS, 'peak measured by'], undefined, ['peak_mem_bytes', RSS])
    );
    const stages = asRecords(summary.pipeline?.stages ?? []);
    if (stages.length) {
      const per = stages.map(s => ({
        stage: s.stage,
        ranks: Array.isArray(s.ranks) ? s.ranks.join(', ') : '',
        peak_mem_bytes: s.peak_mem_bytes,
        [RSS]: s.rss_bytes
      }));
      box.append(
        el('h4', undefined, 'memory per pipeline stage: the recorded peak of its ranks'),
        table(per, ['stage', 'ranks', 'peak_mem_bytes', RSS], undefined, ['peak_mem_bytes', RSS])
      );
    }
    if (summary.peak_mem_bytes !== undefined) {
      box.appendChild(el('div', 'pw-note', `peak ${formatBytes(Number(summary.peak_mem_bytes))}: the largest recorded peak of any rank`));
    }
    this.host.appendChild(box);
  }

  /** One pipeline step as stage rows of forward (F) and backward (B) bars, coloured by microbatch, with
   * the measured bubble against the theory; a step picker for the other complete steps. */
  private async drawPipeline(box: HTMLElement, step?: number): Promise<void> {
    let p: Json;
    try {
      p = await requestAPI('run/pipeline', { path: this.path, step });
    } catch (err) {
      box.replaceChildren(el('h4', undefined, 'pipeline timeline'), el('div', 'pw-note', errorText(err)));
      return;
    }
    const rows: Json[] = p.rows ?? [];
    const index = new Map(rows.map((r, i) => [`${r.stage}/${r.rank}`, i]));
    const bars = (p.bars ?? []).map((b: Json) => ({
      row: index.get(`${b.stage}/${b.rank}`) ?? 0,
      start: Number(b.start_ms),
      end: Number(b.end_ms),
      group: Number(b.microbatch),
      label: `${b.phase}${b.microbatch}`,
      light: b.phase === 'B',
      tip: `stage ${b.stage} (rank ${b.rank}), microbatch ${b.microbatch} ${b.phase}: ` +
        `${(Number(b.end_ms) - Number(b.start_ms)).toFixed(2)} ms from ${Number(b.start_ms).toFixed(2)} ms`
    }));
    const pct = (x: Json) => `${Math.round(Number(x) * 100)}%`;
    const bar = el('div', 'pw-toolbar');
    const pick = el('select', 'pw-pipeline-step');
    for (const s of p.steps ?? []) {
      const o = el('option', undefined, `step ${s}`);
      o.value = String(s);
      o.selected = s === p.step;
      pick.appendChild(o);
    }
    pick.addEventListener('change', () => {
      this.pipelineStep = Number(pick.value); // kept while a live run refreshes
      void this.drawPipeline(box, this.pipelineStep);
    });
    const shape = p.stages_per_rank > 1 ? `p=${p.pp}, m=${p.microbatches}, v=${p.stages_per_rank}` : `p=${p.pp}, m=${p.microbatches}`;
    bar.append(
      pick,
      el('span', 'pw-note pw-bubble', `${p.schedule ?? 'pipeline'}, ${shape}: bubble measured ${pct(p.bubble_measured)} vs theory ${pct(p.bubble_theory)}; F solid, B light; colour = microbatch`)
    );
    box.replaceChildren(
      el('h4', undefined, `pipeline timeline, step ${p.step}`),
      bar,
      gantt(rows.map(r => `stage ${r.stage} · rank ${r.rank}`), bars, { xLabel: "ms from the step's first forward" })
    );
  }
}

// ---------------------------------------------------------------- plan table

export class PlanView {
  constructor(readonly host: HTMLElement, readonly path: string, readonly info: Json) {}

  async render(): Promise<void> {
    let p: Json;
    try {
      p = await requestAPI('plan', { path: this.path, offset: 0, limit: 256 });
    } catch (err) {
      showError(this.host, err);
      return;
    }
    const cats: string[] = p.categories ?? ['parameter', 'gradient', 'optimizer', 'master', 'total'];
    this.host.replaceChildren(summaryTable(p, ['path', 'offset', 'limit']));
    if (p.summary) {
      this.host.append(el('h4', undefined, 'summary'), typeof p.summary === 'string' ? el('pre', undefined, p.summary) : jsonView(p.summary));
    }
    if (p.mesh) {
      this.host.append(el('h4', undefined, 'mesh'), table([p.mesh]));
    }
    if (Array.isArray(p.distinct) && p.distinct.length) {
      this.host.append(el('h4', undefined, `bytes per rank (${p.n_distinct ?? p.distinct.length} distinct layouts)`), table(p.distinct, ['ranks', 'count', ...cats], undefined, cats));
    }
    if (Array.isArray(p.rows) && p.rows.length) {
      const rows = p.rows.map((r: Json) => ({ ...r, coords: r.coords ? Object.entries(r.coords).map(([k, v]) => `${k}=${v}`).join(' ') : '' }));
      const box = el('details');
      box.append(el('summary', undefined, `per rank (first ${rows.length} of ${p.world_size ?? rows.length})`), table(rows, ['rank', 'coords', ...cats], undefined, cats));
      this.host.appendChild(box);
    }
    if (Array.isArray(p.comm) && p.comm.length) {
      this.host.append(el('h4', undefined, 'communication per step'), table(asRecords(p.comm)));
    }
    if (Array.isArray(p.notes) && p.notes.length) {
      this.host.append(el('h4', undefined, 'notes'), jsonView(p.notes));
    }
  }
}

// ---------------------------------------------------------------- actions (verify, diff, load dry run)

export async function renderAction(host: HTMLElement, endpoint: string, params: Record<string, string>): Promise<void> {
  host.replaceChildren(el('div', 'pw-note', `running ${endpoint}…`));
  let result: Json;
  try {
    result = await requestAPI(endpoint, params);
  } catch (err) {
    showError(host, err);
    return;
  }
  host.replaceChildren();
  const verdicts: [string, string, string][] = [
    ['ok', 'checkpoint verified: no problems', 'checkpoint has problems'],
    ['loadable', 'loads into the target layout', 'will not load into the target layout']
  ];
  // A diff's verdict is about tensors (workbench.checkpoint.diff): red only when tensors differ, and its
  // banner names the kinds that differ, or what is equal and what one side alone holds.
  if (typeof result.verdict === 'string') {
    const cls = result.verdict === 'different' ? 'pw-error' : result.verdict === 'not compared' ? 'pw-note' : 'pw-ok';
    host.appendChild(el('div', `${cls} pw-verdict`, String(result.banner ?? result.verdict)));
  }
  for (const [field, yes, no] of verdicts) {
    if (typeof result[field] === 'boolean') {
      host.appendChild(el('div', result[field] ? 'pw-ok pw-verdict' : 'pw-error pw-verdict', result[field] ? yes : no));
    }
  }
  if (result.layout_error) {
    host.appendChild(el('div', 'pw-error', String(result.layout_error)));
  }
  for (const reason of result.reasons ?? []) {
    host.appendChild(el('div', 'pw-error', String(reason)));
  }
  for (const p of result.problems ?? []) {
    host.appendChild(el('div', 'pw-error', String(p.message ?? `${p.file}: ${p.problem}; ${p.fix}`)));
  }
  const shown = { ...result };
  delete shown.labels;
  delete shown.banner; // (the verdict line above)
  host.appendChild(ckptJson(shown, result.labels));
}

export { WorkbenchError };
