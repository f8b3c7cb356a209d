# Loss and accuracy curves of fashion_mnist --metrics files (CSV with a header:
# epoch,train_loss,test_loss,test_accuracy,...). `make plot` calls it as
#   gnuplot -e "gradagg='A.csv'; single='B.csv'; out='fashion_mnist.png'" fashion_mnist.gp
# with `single` (the same model trained in one process) optional.
if (!exists("out")) out = "fashion_mnist.png"
if (!exists("single")) single = ""
set terminal pngcairo size 1000,420 enhanced font ",11"
set output out
set datafile separator ","
set style data linespoints
set grid
set xlabel "epoch"
set xtics 1
set key top right
if (!exists("heading")) heading = "Fashion-MNIST, Dense(64, relu) -> Dense(10): gradagg workers, and one process on the same batches (dashed)"
set multiplot layout 1,2 title heading

set title "loss"
set ylabel "mean cross-entropy"
if (single ne "") {
  plot gradagg skip 1 using 1:2 title "train, gradagg" lw 2 pt 7 lc rgb "#1f77b4", \
       gradagg skip 1 using 1:3 title "test, gradagg" lw 2 pt 5 lc rgb "#d62728", \
       single skip 1 using 1:2 title "train, one process" lw 1 dt 2 pt 6 lc rgb "#1f77b4", \
       single skip 1 using 1:3 title "test, one process" lw 1 dt 2 pt 4 lc rgb "#d62728"
} else {
  plot gradagg skip 1 using 1:2 title "train" lw 2 pt 7 lc rgb "#1f77b4", \
       gradagg skip 1 using 1:3 title "test" lw 2 pt 5 lc rgb "#d62728"
}

set title "test accuracy"
set ylabel "accuracy"
set key bottom right
if (single ne "") {
  plot gradagg skip 1 using 1:4 title "gradagg" lw 2 pt 7 lc rgb "#2ca02c", \
       single skip 1 using 1:4 title "one process" lw 1 dt 2 pt 6 lc rgb "#000000"
} else {
  plot gradagg skip 1 using 1:4 title "gradagg" lw 2 pt 7 lc rgb "#2ca02c"
}
unset multiplot
