// Parallel Workbench in JupyterLab: file types for checkpoints, memory snapshots, runs and plans, a
// kernel-less document tab that renders them from the server extension's sliced answers, and
// file-browser context-menu items (Open in Workbench, Verify checkpoint, Compare with…, Will it load into…).
// Open Workbench tabs come back after a page reload (ILayoutRestorer with one WidgetTracker per kind).
import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { Dialog, MainAreaWidget, WidgetTracker, showDialog } from '@jupyterlab/apputils';
import {
  ABCWidgetFactory,
  DocumentModel,
  DocumentRegistry,
  DocumentWidget,
  IDocumentWidget,
  TextModelFactory
} from '@jupyterlab/docregistry';
import { FileDialog, IFileBrowserFactory } from '@jupyterlab/filebrowser';
import { Contents } from '@jupyterlab/services';
import type { ReadonlyJSONObject } from '@lumino/coreutils';
import { Widget } from '@lumino/widgets';
import { Kind, setCommandRunner } from './views';
import { WorkbenchView } from './widget';

const FACTORY = 'Parallel Workbench';
const MODEL = 'workbench-lazy';

/** File type name -> (how it is recognised, which view). */
const FILE_TYPES: { name: string; label: string; extensions: string[]; pattern?: string; view: Kind }[] = [
  { name: 'workbench-safetensors', label: 'safetensors checkpoint', extensions: ['.safetensors'], view: 'checkpoint' },
  {
    name: 'workbench-safetensors-index',
    label: 'safetensors index',
    extensions: ['.safetensors.index.json'],
    pattern: '^.*\\.safetensors\\.index\\.json$',
    view: 'checkpoint'
  },
  { name: 'workbench-torch', label: 'torch.save checkpoint', extensions: ['.pt', '.pth', '.bin'], view: 'checkpoint' },
  { name: 'workbench-dcp-metadata', label: 'DCP checkpoint metadata', extensions: [], pattern: '^\\.metadata$', view: 'checkpoint' },
  { name: 'workbench-snapshot', label: 'torch memory snapshot', extensions: ['.pickle'], view: 'memory' },
  { name: 'workbench-run', label: 'run events', extensions: [], pattern: '^events\\.jsonl$', view: 'run' },
  { name: 'workbench-plan', label: 'sharding plan', extensions: ['.plan.json'], pattern: '^.*\\.plan\\.json$', view: 'plan' },
  {
    name: 'workbench-trace',
    label: 'profiler trace (step time)',
    extensions: ['.pt.trace.json', '.pt.trace.json.gz'],
    pattern: '^.*\\.pt\\.trace\\.json(\\.gz)?$',
    view: 'time'
  }
];

/**
 * A model that never holds the file: the context asks the contents API for metadata only
 * (fileFormat null means content=false), so a 50 GB checkpoint is never fetched as base64.
 */
class LazyModelFactory extends TextModelFactory {
  constructor() {
    super(false);
  }
  get name(): string {
    return MODEL;
  }
  get fileFormat(): Contents.FileFormat {
    return null;
  }
  createNew(options: Parameters<TextModelFactory['createNew']>[0] = {}): DocumentModel {
    return new ReadOnlyModel({ ...options, collaborationEnabled: false });
  }
}

/**
 * The views never save, so the context must not either: a context whose model is "collaborative" has
 * canSave false, and then it makes no checkpoint when the file opens. Otherwise JupyterLab copies the
 * opened file into .ipynb_checkpoints/ (a 1 GB snapshot, copied whole on the server).
 */
class ReadOnlyModel extends DocumentModel {
  get collaborative(): boolean {
    return true;
  }
}

class WorkbenchFactory extends ABCWidgetFactory<IDocumentWidget<WorkbenchView>> {
  protected createNewWidget(context: DocumentRegistry.Context): IDocumentWidget<WorkbenchView> {
    const ft = FILE_TYPES.find(t => context.path && matches(t, context.path));
    const content = new WorkbenchView({ path: context.path, hint: ft?.view });
    const widget = new DocumentWidget({ content, context });
    widget.addClass('pw-document');
    return widget;
  }
}

function matches(t: (typeof FILE_TYPES)[number], path: string): boolean {
  const name = path.split('/').pop() ?? path;
  return (t.pattern !== undefined && new RegExp(t.pattern).test(name)) || t.extensions.some(e => name.toLowerCase().endsWith(e));
}

let counter = 0;

function baseName(path: string): string {
  return path.split('/').filter(Boolean).pop() || path || '/';
}

/** The panels (directories, verify/diff/load dry runs) the layout restorer reopens after a reload. */
const panels = new WidgetTracker<MainAreaWidget<WorkbenchView>>({ namespace: 'parallel-workbench-panel' });

function openPanel(app: JupyterFrontEnd, content: WorkbenchView, label: string): void {
  // The same view twice is one tab (and one tab after a reload: the restorer keys them by what they show).
  const key = JSON.stringify(viewArgs(content.options));
  const open = panels.find(w => JSON.stringify(viewArgs(w.content.options)) === key);
  if (open) {
    content.dispose();
    app.shell.activateById(open.id);
    return;
  }
  const panel = new MainAreaWidget({ content });
  panel.id = `parallel-workbench-${++counter}`;
  panel.title.label = label;
  panel.title.closable = true;
  panel.addClass('pw-document');
  app.shell.add(panel, 'main');
  void panels.add(panel);
  app.shell.activateById(panel.id);
}

/** What a panel shows: its path and action. */
function viewArgs(options: WorkbenchView['options']): Record<string, string | Record<string, string>> {
  const args: Record<string, string | Record<string, string>> = { path: options.path };
  if (options.action) {
    args.endpoint = options.action.endpoint;
    args.params = options.action.params;
  }
  return args;
}

/** What reopens a panel: its path, action and title (a JSON object the restorer stores). */
function panelArgs(panel: MainAreaWidget<WorkbenchView>): ReadonlyJSONObject {
  return { ...viewArgs(panel.content.options), label: panel.title.label };
}

/** The dialog body of a path question: a text field (a typed path is still accepted). */
class PathBody extends Widget implements Dialog.IBodyWidget<string> {
  constructor(value: string, placeholder: string) {
    super();
    this.input = document.createElement('input');
    this.input.className = 'jp-mod-styled pw-path-input';
    this.input.value = value;
    this.input.placeholder = placeholder;
    this.input.style.width = '100%';
    this.node.appendChild(this.input);
  }
  readonly input: HTMLInputElement;
  getValue(): string {
    return this.input.value.trim();
  }
}

/** Checkpoints a picker offers: directories (DCP steps, run directories) and checkpoint files. */
function pickable(m: Contents.IModel): boolean {
  return m.type === 'directory' || /\.(safetensors|pt|pth|bin)$|\.safetensors\.index\.json$/i.test(m.name);
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'parallel-workbench-lab:plugin',
  description: 'Open checkpoints, memory snapshots, runs and sharding plans from the file browser.',
  autoStart: true,
  optional: [IFileBrowserFactory, ILayoutRestorer],
  activate: (app: JupyterFrontEnd, browsers: IFileBrowserFactory | null, restorer: ILayoutRestorer | null) => {
    const registry = app.docRegistry;
    for (const t of FILE_TYPES) {
      registry.addFileType({
        name: t.name,
        displayName: t.label,
        extensions: t.extensions,
        pattern: t.pattern,
        mimeTypes: ['application/octet-stream'],
        contentType: 'file',
        fileFormat: null as unknown as Contents.FileFormat,
        iconClass: 'jp-MaterialIcon jp-FileIcon'
      });
    }
    registry.addModelFactory(new LazyModelFactory());
    const documents = new WidgetTracker<IDocumentWidget<WorkbenchView>>({ namespace: 'parallel-workbench-doc' });
    const factory = new WorkbenchFactory({
        name: FACTORY,
        label: 'Parallel Workbench',
        modelName: MODEL,
        fileTypes: FILE_TYPES.map(t => t.name),
        defaultFor: FILE_TYPES.map(t => t.name),
        readOnly: true,
        canStartKernel: false,
        preferKernel: false
    });
    factory.widgetCreated.connect((_, widget) => {
      widget.context.pathChanged.connect(() => void documents.save(widget));
      void documents.add(widget);
    });
    registry.addWidgetFactory(factory);

    app.commands.addCommand('parallel-workbench:panel', {
      label: 'Reopen a Workbench panel',
      execute: args => {
        const path = args.path as string;
        const endpoint = args.endpoint as string | undefined;
        const params = (args.params ?? {}) as Record<string, string>;
        const action = endpoint ? { endpoint, params } : undefined;
        openPanel(app, new WorkbenchView({ path, action }), (args.label as string) ?? baseName(path));
      }
    });
    if (restorer) {
      void restorer.restore(documents, {
        command: 'docmanager:open',
        args: w => ({ path: w.context.path, factory: FACTORY }),
        name: w => w.context.path
      });
      void restorer.restore(panels, {
        command: 'parallel-workbench:panel',
        args: panelArgs,
        name: w => JSON.stringify(viewArgs(w.content.options))
      });
    }

    setCommandRunner((command, args) => void app.commands.execute(command, args));

    /** A typed answer, or a path picked in a file dialog ("Browse…"). The picker starts in the run
     * directory above a checkpoints/ folder, which no file browser can enter: pick the folder itself (its
     * latest step) or a run directory. Null: cancelled. */
    const ask = async (o: {
      title: string;
      placeholder: string;
      accept: string;
      near: string;
      label: string;
      pickable: (m: Contents.IModel) => boolean;
    }): Promise<{ typed: string } | { picked: string } | null> => {
      const body = new PathBody('', o.placeholder);
      const manager = (browsers?.tracker.currentWidget ?? browsers?.tracker.find(() => true))?.model.manager;
      const browse = Dialog.createButton({ label: 'Browse…', accept: false, actions: ['browse'], className: 'pw-browse' });
      const ok = Dialog.okButton({ label: o.accept });
      const answer = await showDialog({
        title: o.title,
        body,
        buttons: manager ? [Dialog.cancelButton(), browse, ok] : [Dialog.cancelButton(), ok],
        focusNodeSelector: 'input'
      });
      if (answer.button.accept) {
        return { typed: answer.value ?? '' };
      }
      if (!manager || !answer.button.actions.includes('browse')) {
        return null;
      }
      const parts = o.near.split('/');
      const at = parts.indexOf('checkpoints');
      const picked = await FileDialog.getOpenFiles({
        manager,
        title: o.title,
        defaultPath: at >= 0 ? parts.slice(0, at).join('/') : parts.slice(0, -1).join('/'),
        label: o.label,
        filter: m => (o.pickable(m) ? {} : null)
      });
      if (!picked.button.accept || !picked.value?.length) {
        return null;
      }
      return { picked: picked.value[0].path };
    };

    const selected = (): Contents.IModel[] => {
      const browser = browsers?.tracker.currentWidget;
      return browser ? Array.from(browser.selectedItems()) : [];
    };
    const first = (): Contents.IModel | undefined => selected()[0];

    app.commands.addCommand('parallel-workbench:open', {
      label: 'Open in Workbench',
      execute: async args => {
        const path = (args.path as string) ?? first()?.path;
        if (!path) {
          return;
        }
        const item = args.path ? undefined : first();
        if (item && item.type !== 'directory') {
          await app.commands.execute('docmanager:open', { path, factory: FACTORY });
          return;
        }
        openPanel(app, new WorkbenchView({ path }), baseName(path));
      }
    });
    app.commands.addCommand('parallel-workbench:verify', {
      label: 'Verify checkpoint',
      execute: args => {
        const path = (args.path as string) ?? first()?.path;
        if (path) {
          openPanel(app, new WorkbenchView({ path, action: { endpoint: 'checkpoint/verify', params: {} } }), `verify ${baseName(path)}`);
        }
      }
    });
    app.commands.addCommand('parallel-workbench:diff', {
      label: 'Compare with…',
      execute: async args => {
        const items = selected();
        const path = (args.path as string) ?? items[0]?.path;
        if (!path) {
          return;
        }
        let other: string | undefined = (args.other as string) ?? (args.path ? undefined : items[1]?.path);
        if (!other) {
          const answer = await ask({
            title: `Compare ${path} with…`,
            placeholder: 'path of the other checkpoint, relative to the server root',
            accept: 'Compare',
            near: path,
            label: 'A checkpoint file or directory, or a run directory (its latest checkpoint)',
            pickable
          });
          other = answer === null ? undefined : 'picked' in answer ? answer.picked : answer.typed.trim();
          if (!other) {
            return;
          }
        }
        openPanel(app, new WorkbenchView({ path, action: { endpoint: 'checkpoint/diff', params: { other } } }), `diff ${baseName(path)}`);
      }
    });
    app.commands.addCommand('parallel-workbench:plan-load', {
      label: 'Will it load into…',
      execute: async args => {
        const path = (args.path as string) ?? first()?.path;
        if (!path) {
          return;
        }
        let layout = args.layout as string | undefined;
        let like = args.like as string | undefined;
        if (layout === undefined && like === undefined) {
          const answer = await ask({
            title: `Will ${path} load into…`,
            placeholder: "target layout, e.g. dp_shard=2 tp=2 (empty: the checkpoint's own)",
            accept: 'Check',
            near: path,
            label: "A run directory, its config.json or a plan JSON: its layout (and model) is the target",
            pickable: m => m.type === 'directory' || /\.json$/i.test(m.name)
          });
          if (answer === null) {
            return;
          }
          if ('picked' in answer) {
            like = answer.picked;
          } else {
            layout = answer.typed;
          }
        }
        const to = (layout ?? '').trim().split(/[\s,]+/).filter(Boolean).join(',');
        const params: Record<string, string> = like ? { like } : to ? { to } : {};
        const action = { endpoint: 'checkpoint/plan-load', params };
        openPanel(app, new WorkbenchView({ path, action }), `load dry run ${baseName(path)}`);
      }
    });

    const dirs = '.jp-DirListing-item[data-isdir="true"]';
    // Lumino takes one simple selector per item (no comma lists).
    const checkpointFiles = ['workbench-safetensors', 'workbench-safetensors-index', 'workbench-torch'].map(
      t => `.jp-DirListing-item[data-file-type="${t}"]`
    );
    app.contextMenu.addItem({ command: 'parallel-workbench:open', selector: dirs, rank: 1 });
    for (const selector of [dirs, ...checkpointFiles]) {
      app.contextMenu.addItem({ command: 'parallel-workbench:verify', selector, rank: 2 });
      app.contextMenu.addItem({ command: 'parallel-workbench:diff', selector, rank: 3 });
      app.contextMenu.addItem({ command: 'parallel-workbench:plan-load', selector, rank: 4 });
    }
  }
};

export default plugin;
