"""The authors' linear evaluations of a finished run, a second
command, as their own main_lincls.py is: a linear classifier on
the frozen backbone's features of crop + flip views, then its
test top-1.

    python benchmarks/linear_eval.py RUN --protocol moco
    python benchmarks/linear_eval.py RUN --protocol gsg-cifar \\
        --epochs 2  # shortened
    torchrun --nproc_per_node=8 benchmarks/linear_eval.py RUN \\
        --protocol simsiam-imagenet  # ImageNet, 8 GPUs

RUN is a run folder (a script's --out) that holds results.json.
It reads the run's options from RUN/config.json and its network
from RUN/backbone.pt, and writes RUN/linear_PROTOCOL.json.
"""
import argparse
import json
import math
import os
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
import common  # noqa: E402

# Each protocol's settings; lr per 256 images, momentum 0.9.
PROTOCOLS = {
    # GSG paper, Sec. 5.1 "Linear evaluation" (CIFAR-10). Its
    # views (crop + flip) and wd 0 are this project's assumption.
    "gsg-cifar": dict(
        optimizer="sgd", lr=30.0, epochs=90, batch=256, schedule="cosine"),
    # facebookresearch/moco main_lincls.py: --lr 30, -b 256,
    # --epochs 100, --schedule 60 80, wd 0.
    "moco": dict(
        optimizer="sgd", lr=30.0, epochs=100, batch=256, schedule="steps"),
    # facebookresearch/simsiam main_lincls.py --lars (bych-lee/gsg
    # uses it too): apex's LARC, no clipping, on the bias too.
    "simsiam-imagenet": dict(
        optimizer="lars", lr=0.1, epochs=90, batch=4096, schedule="cosine"),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=common.HelpFormatter)
    a = parser.add_argument
    a("run", help="a finished run's folder")
    a("--protocol", choices=list(PROTOCOLS), required=True,
      help="the authors' settings: PROTOCOLS in this file")
    a("--epochs", type=common.positive_int,
      help="fewer epochs (None: the protocol's)")
    a("--data-dir", help="where the data is (None: the run's)")
    a("--workers", type=common.non_negative_int,
      help="image folder decoders a process (None: the run's)")
    a("--device", type=common.device_name,
      help="cuda or cpu (None: the run's)")
    return parser.parse_args(argv)


def learning_rate(epoch, epochs, peak, schedule):
    """main_lincls.py's adjust_learning_rate, by epoch."""
    if schedule == "cosine":
        return peak * 0.5 * (1 + math.cos(math.pi * epoch / epochs))
    # MoCo's steps: x0.1 at epochs 60 and 80 of 100; here at 60%, 80%
    passed = sum(epoch >= f * epochs for f in (0.6, 0.8))
    return peak * 0.1 ** passed


def linear_eval(backbone, data, ctx, protocol, test, epochs, seed=0,
                workers=0):
    """A protocol's probe on the frozen backbone, crop + flip views;
    `test`: the test split's (features, labels) -> top-1 %."""
    own = PROTOCOLS[protocol]
    if data.streaming:  # the workers crop and flip
        images = common.ImageFiles(
            data.eval_train.samples, data.image_size, crops=1)
        labels = data.train_labels
    else:
        images, labels = data.eval_train
    probe_set = replace(data, train=images, train_labels=labels)
    batch = max(1, min(own["batch"], len(labels)) // ctx.world)
    batch = batch * ctx.world  # global, split evenly
    peak = own["lr"] * batch / 256
    classifier = common.linear_classifier(
        backbone.out_dim, data.num_classes, ctx.device, seed, std=0.01)
    params = classifier.parameters()
    if own["optimizer"] == "lars":
        optimizer = common.LARS(params, peak, momentum=0.9, eta=0.001)
    else:
        optimizer = torch.optim.SGD(params, peak, 0.9)
    recipe = common.Recipe(jitter=(0, 0, 0, 0), gray_p=0)
    augment = common.Augment(
        [recipe], data.image_size, data.mean, data.std, ctx)
    backbone.eval()  # BatchNorm keeps its statistics
    for epoch in tqdm(range(epochs), "linear probe",
                      disable=common.hide_bar(ctx.rank)):
        lr = learning_rate(epoch, epochs, peak, own["schedule"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        order, views = common.epoch_generators(seed + 1, epoch)
        for x, y in common.train_batches(
                probe_set, batch, order, ctx, workers):
            x = augment(x, views)[0]  # float32, as in pre-training
            with torch.no_grad(), ctx.autocast():
                features = backbone(x).float()
            loss = F.cross_entropy(classifier(features), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if ctx.world > 1:  # the mean of the ranks' gradients
                for p in classifier.parameters():
                    p.grad = common.all_reduce_sum(p.grad) / ctx.world
            optimizer.step()
    return common.top1(classifier, *test)


def main(argv=None):
    args = parse_args(argv)
    with open(os.path.join(args.run, "config.json")) as f:
        run = argparse.Namespace(**json.load(f)["args"])
    with open(os.path.join(args.run, "results.json")) as f:
        results = json.load(f)
    for name in ("data_dir", "workers", "device"):
        if getattr(args, name) is not None:
            setattr(run, name, getattr(args, name))
    run.out = args.run
    ctx = common.setup(run)
    data = common.load_data(run, ctx)
    # the inputs' normalisation the backbone was trained with
    data.mean, data.std = results["mean"], results["std"]
    backbone = common.ResNet(
        run.arch, run.width, data.image_size, run.stem_padding)
    weights = torch.load(os.path.join(args.run, "backbone.pt"),
                         map_location="cpu", weights_only=True)
    backbone.load_state_dict(weights)
    backbone.to(ctx.device)
    if ctx.device.type == "cuda":
        backbone = backbone.to(memory_format=torch.channels_last)
    test = common.extract_features(backbone, data.eval_test, data, ctx,
                                   run.workers, unit=False)
    epochs = args.epochs or PROTOCOLS[args.protocol]["epochs"]
    top1 = linear_eval(backbone, data, ctx, args.protocol, test, epochs,
                       run.seed, run.workers)
    result = dict(protocol=args.protocol, epochs=epochs, linear_top1=top1)
    if ctx.rank == 0:
        path = os.path.join(args.run, f"linear_{args.protocol}.json")
        common.write_atomic(path, json.dumps(result, indent=2).encode())
        ctx.print(f"linear top-1 {top1:.2f} ({args.protocol}, {epochs} "
                  f"epochs), written to {path}")


if __name__ == "__main__":
    common.run(main)
