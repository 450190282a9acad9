# TackleBox 1.0.3, "Hook Management - part 2.ipynb", its code cells as a script, ported: CPU, a tiny XLM with random
# weights and a synthetic batch in place of xlm-mlm-ende-1024 and Multi30k (lines marked "port").
import torch
import torch.nn as nn
from tacklebox.hook_management import HookManager
from _xlm import PAD, batch, tiny_xlm  # port

if __name__ == '__main__':
    vocab_en, vocab_de = range(60), range(70)  # port: spacy tokenizers, torchtext fields and vocabularies
    pad_idx = PAD  # port

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

    # import and initialize the hook manager
    hookmngr = HookManager()

    # define named modules, including the embedding layer (id=embedding) and final attention (id=final_attn)
    named_modules = {
        'embedding': xlm.transformer.embeddings,
        'final_attn': xlm.transformer.attentions[-1]
    }

    # forward pre-hook function signature: (module, inputs)
    def zero_input(module, inputs):
        ret = []
        zeroed = 0
        for input in inputs:
            if type(input) == torch.Tensor and input.dtype == torch.float:
                ret += [input - input]
                zeroed += 1
            else:
                ret += [input]
        print('Set %d/%d of %s inputs to zero' % (zeroed, len(inputs), module.name))
        return tuple(ret)

    def print_mean(module, inputs, outputs):
        print('%s input mean = %.2f, output mean = %.2f' % (module.name,
                                                            inputs[0].sum().item() / inputs[0].numel(),
                                                            outputs[0].sum().item() / outputs[0].numel()))

    # register both hooks on all named modules, deferring activation
    hookmngr.register_forward_pre_hook(zero_input, hook_fn_name='zero_input', activate=False, **named_modules)
    hookmngr.register_forward_hook(print_mean, hook_fn_name='print_mean', activate=False, **named_modules)

    # activate all hooks
    with hookmngr.hook_all_context() + torch.no_grad():
        xlm(src)

    # lets only activate our forward hooks
    with hookmngr.hook_all_context(category='forward_hook') + torch.no_grad():
        xlm(src)

    # now lets use only our original hook function, print_mean
    with hookmngr.hook_all_context(hook_types=[print_mean]) + torch.no_grad():
        xlm(src)

    # backward hooks
    def print_grad_shape(module, grad_in, grad_out):
        print('%s ' % module.name, end='')
        if grad_in[0] is not None:
            print('grad_in shape: ', grad_in[0].shape, end=', ')
        if grad_out[0] is not None:
            print('grad_out shape: ', grad_out[0].shape, end='')
        print('')

    # register backward hook print_grad_shape on the final attentionlayer
    hookmngr.register_backward_hook(print_grad_shape, named_modules['final_attn'],
                                   activate=False, hook_fn_name='print_grad_shape')

    # Note: can pass modules as additional args if already registered

    # activate all backward hooks
    with hookmngr.hook_all_context(category='backward_hook'):
        out, = xlm(src)
        mt_loss(out, trg).backward()

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

    # use retain_forward_cache argument to provide hook function access to forward pass data during backward pass
    hookmngr.register_backward_hook(print_outputs_with_grad, named_modules['final_attn'],
                                   activate=False, hook_fn_name='print_outputs_with_grad',
                                   retain_forward_cache=True)

    # activate only print_outputs_with_grad
    with hookmngr.hook_all_context(hook_types=[print_outputs_with_grad]):
        out, = xlm(src)
        mt_loss(out, trg).backward()

    print('\n'.join(hookmngr.name_to_hookhandle.keys()))

    # remove print_mean from final_attn
    hookmngr.remove_hook_by_name('print_mean[final_attn]')

    print('\n'.join(hookmngr.name_to_hookhandle.keys()))

    # remove zero_input from all modules
    hookmngr.remove_hook_function(zero_input)

    print('\n'.join(hookmngr.name_to_hookhandle.keys()))

    # remove all remaining hooks from final_attn
    hookmngr.remove_module_by_name('final_attn')

    print('\n'.join(hookmngr.name_to_hookhandle.keys()))
