// Parallel Workbench in JupyterLab: file types for checkpoints, memory snapshots, runs and plans, a
// kernel-less document tab that renders them from the server extension's sliced answers, and
// file-browser context-menu items (Open in Workbench, Verify checkpoint, Compare with…, Will it load into…).
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { InputDialog, MainAreaWidget } from '@jupyterlab/apputils';
import { ABCWidgetFactory, DocumentRegistry, DocumentWidget, IDocumentWidget, TextModelFactory } from '@jupyterlab/docregistry';
import { IFileBrowserFactory } from '@jupyterlab/filebrowser';
import { Contents } from '@jupyterlab/services';
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
  { name: 'workbench-plan', label: 'sharding plan', extensions: ['.plan.json'], pattern: '^.*\\.plan\\.json$', view: 'plan' }
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

function openPanel(app: JupyterFrontEnd, content: WorkbenchView, label: string): void {
  const panel = new MainAreaWidget({ content });
  panel.id = `parallel-workbench-${++counter}`;
  panel.title.label = label;
  panel.title.closable = true;
  panel.addClass('pw-document');
  app.shell.add(panel, 'main');
  app.shell.activateById(panel.id);
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'parallel-workbench-lab:plugin',
  description: 'Open checkpoints, memory snapshots, runs and sharding plans from the file browser.',
  autoStart: true,
  optional: [IFileBrowserFactory],
  activate: (app: JupyterFrontEnd, browsers: IFileBrowserFactory | null) => {
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
    registry.addWidgetFactory(
      new WorkbenchFactory({
        name: FACTORY,
        label: 'Parallel Workbench',
        modelName: MODEL,
        fileTypes: FILE_TYPES.map(t => t.name),
        defaultFor: FILE_TYPES.map(t => t.name),
        readOnly: true,
        canStartKernel: false,
        preferKernel: false
      })
    );

    setCommandRunner((command, args) => void app.commands.execute(command, args));

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
        let other = (args.other as string) ?? (args.path ? undefined : items[1]?.path);
        if (!other) {
          const answer = await InputDialog.getText({
            title: `Compare ${path} with…`,
            placeholder: 'path of the other checkpoint, relative to the server root'
          });
          if (!answer.button.accept || !answer.value) {
            return;
          }
          other = answer.value;
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
        if (layout === undefined) {
          const answer = await InputDialog.getText({
            title: `Will ${path} load into…`,
            placeholder: 'target layout, e.g. dp_shard=2 tp=2 (empty: the checkpoint\'s own)'
          });
          if (!answer.button.accept) {
            return;
          }
          layout = answer.value ?? '';
        }
        const to = layout.trim().split(/[\s,]+/).filter(Boolean).join(',');
        const params: Record<string, string> = to ? { to } : {};
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
