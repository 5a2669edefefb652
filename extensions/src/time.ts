// The step-time tab: a profiler trace (*.pt.trace.json[.gz]), a folder of per-rank traces or a saved step
// timeline, one step at a time. Everything drawn comes from the server's `time/timeline` answer
// (workbench.jupyter.steptimes: the bars, totals and colours StepTimelineView draws in a notebook).
import { Json, errorText, requestAPI } from './api';
import { IGanttBar, el, gantt, table } from './render';

export class TimeView {
  constructor(readonly host: HTMLElement, readonly path: string, readonly info: Json) {}

  private step: number | undefined;

  async render(): Promise<void> {
    let t: Json;
    try {
      t = await requestAPI('time/timeline', { path: this.path, step: this.step });
    } catch (err) {
      this.host.replaceChildren(el('div', 'pw-error', errorText(err)));
      return;
    }
    const colors: Record<string, string> = t.colors ?? {};
    const rows: Json[] = t.rows ?? [];
    const bars: IGanttBar[] = (t.bars ?? []).map((b: Json) => ({
      row: Number(b.row),
      start: Number(b.start_ms),
      end: Number(b.end_ms),
      group: 0,
      color: colors[b.category] ?? '#7f7f7f',
      label: String(b.category),
      tip: `${b.category}: ${String(b.name)} (${b.spans} span(s), busy ${Number(b.busy_ms).toFixed(3)} ms) ` +
        `${Number(b.start_ms).toFixed(3)} to ${Number(b.end_ms).toFixed(3)} ms`
    }));
    const bar = el('div', 'pw-toolbar');
    const pick = el('select', 'pw-time-step');
    for (const [value, label] of [[-1, 'all steps'], ...(t.steps ?? []).map((s: number) => [s, `step ${s}`])]) {
      const o = el('option', undefined, String(label));
      o.value = String(value);
      o.selected = value === t.step;
      pick.appendChild(o);
    }
    pick.addEventListener('change', () => {
      this.step = Number(pick.value);
      void this.render();
    });
    const stepMs = t.step_time_ms === null || t.step_time_ms === undefined ? '' : `; median step ${Number(t.step_time_ms).toFixed(2)} ms`;
    bar.append(
      pick,
      el('span', 'pw-note', `${t.source}, ${t.device}: ${t.ranks.length} rank(s), ${Number(t.spans).toLocaleString()} spans${stepMs}`)
    );
    const legend = el('div', 'pw-legend-box pw-time-legend');
    for (const c of t.categories ?? []) {
      const item = el('span', 'pw-legend-entry');
      const sw = el('span', 'pw-swatch');
      sw.style.background = colors[c] ?? '#7f7f7f';
      item.append(sw, document.createTextNode(c));
      legend.appendChild(item);
    }
    const straggling = new Map<number, Json>((t.stragglers ?? []).map((s: Json) => [Number(s.rank), s]));
    const labels = rows.map(r => {
      const s = straggling.get(Number(r.rank));
      return r.lane === 'compute' && s?.straggler ? `${r.label} ⚠` : String(r.label);
    });
    const ms = (v: Json) => (v === null || v === undefined ? '-' : Number(v).toFixed(2));
    const totals = (t.totals ?? []).map((r: Json) => {
      const s = straggling.get(Number(r.rank));
      const out: Record<string, Json> = { rank: r.rank, 'step (ms)': ms(r.step_ms) };
      for (const c of t.categories ?? []) {
        out[`${c} (ms)`] = ms(r[c]);
      }
      if ('exposed_comm_ms' in r) {
        out['exposed comm (ms)'] = ms(r.exposed_comm_ms);
      }
      if (s) {
        out.straggler = s.straggler ? `yes (+${Math.round(Number(s.excess) * 100)}%)` : 'no';
      }
      return out;
    });
    const what = t.step >= 0 ? `step ${t.step}` : 'every step';
    const notes: HTMLElement[] = [];
    if ((t.ranks_shown ?? []).length < (t.ranks ?? []).length) {
      notes.push(el('div', 'pw-note', `the first ${t.ranks_shown.length} of ${t.ranks.length} ranks shown`));
    }
    if (t.stragglers === null) {
      notes.push(el('div', 'pw-note', 'stragglers and exposed communication need workbench.time.analysis'));
    }
    this.host.replaceChildren(
      bar,
      legend,
      gantt(labels, bars, { title: `where each rank's time goes, ${what}`, xLabel: `ms from the ${t.step >= 0 ? "step's" : "trace's"} first span` }),
      el('h4', undefined, `per rank, ${t.step >= 0 ? 'this step' : 'mean per step'}`),
      table(totals),
      ...notes
    );
    this.host.dataset.step = String(t.step);
  }
}
