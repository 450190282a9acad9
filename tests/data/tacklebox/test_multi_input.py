# TackleBox 1.0.3, tests/test_multi_input.py, ported: CPU, a tiny XLM with random weights and a synthetic batch in
# place of xlm-mlm-ende-1024 and Multi30k (lines marked "port").
import torch
import torch.nn as nn
from tacklebox.hook_management import HookManager
from _xlm import PAD, batch, tiny_xlm  # port


if __name__ == '__main__':
    # load data
    vocab_en, vocab_de = range(60), range(70)  # port: spacy tokenizers, torchtext fields and vocabularies
    pad_idx = PAD  # port

    # load model
    xlm = tiny_xlm()  # port: XLMWithLMHeadModel.from_pretrained('xlm-mlm-ende-1024')
    xlm.transformer.embeddings = nn.Embedding(len(vocab_en), xlm.config.emb_dim, padding_idx=pad_idx)
    xlm.pred_layer.proj = nn.Linear(xlm.config.emb_dim, len(vocab_de), bias=True)

    xent = nn.CrossEntropyLoss()

    src, trg = batch()  # port: next(iter(train_ldr))

    def mt_loss(out, target):
        # only compute loss for non-padding indices
        min_idx = min([out.shape[0], target.shape[0]])
        out, target = out[:min_idx], target[:min_idx]
        mask = (target != pad_idx).type(torch.bool)
        return xent(out[mask], target[mask])


    out, = xlm(src)
    mt_loss(out, trg).backward()

    named_modules = {
        'embedding': xlm.transformer.embeddings,
        'final_attn': xlm.transformer.attentions[-1],
    }

    hookmngr = HookManager()

    # dealing with multiple hook functions

    # forward pre-hook function signature: (module, inputs)
    def zero_input(module, inputs):
        print('Set %s input to zero' % module.name)
        ret = []
        for input in inputs:
            if type(input) == torch.Tensor and input.dtype == torch.float:
                ret += [input - input]
            else:
                ret += [input]
        return tuple(ret)


    def print_mean(module, inputs, outputs):
        print('%s input mean = %.2f, output mean = %.2f' % (module.name,
                                                            inputs[0].sum().item() / inputs[0].numel(),
                                                            outputs[0].sum().item() / outputs[0].numel()))


    hookmngr.register_forward_pre_hook(zero_input, hook_fn_name='zero_input', activate=False, **named_modules)

    # to pass modules without names, pass as args instead of as kwargs
    hookmngr.register_forward_hook(print_mean, *named_modules.values(), hook_fn_name='print_mean', activate=False, )

    # note we could use separate hook manager for XLM

    with hookmngr.hook_all_context() + torch.no_grad():
        xlm(src)

    # lets only activate our forward hooks
    with hookmngr.hook_all_context(category='forward_hook') + torch.no_grad():
        xlm(src)

    # using intermediate outputs with gradient
    def print_outputs_with_grad(module, grad_in, grad_out, inputs, outputs):
        print('%s input-gradient pairs: ' % module.name, end='')
        for inp, grad in zip(inputs, grad_in):
            print(inp.dtype, type(grad), end=', ')
        print('')
        print('%s output-gradient pairs: ' % module.name, end='')
        for out, grad in zip(outputs, grad_out):
            print(out.dtype, type(grad), end=', ')
        print('')

    named_modules = {'attn%d' % i: attn for i, attn in enumerate(xlm.transformer.attentions)}
    hookmngr.register_backward_hook(print_outputs_with_grad, hook_fn_name='print_outputs_with_grad',
                                    activate=False, retain_forward_cache=True, **named_modules)

    with hookmngr.hook_all_context(hook_types=[print_outputs_with_grad]):
        out, = xlm(src)
        mt_loss(out, trg).backward()
