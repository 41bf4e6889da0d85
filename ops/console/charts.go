package console

import (
	"context"
	"fmt"
	"html/template"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/millrace-io/millrace/ops"
)

// Size of a chart: a column of barWidth pixels per minute, chartHeight high.
const (
	barWidth    = 4
	chartHeight = 32
)

// chart is one small chart of the overview: a value per minute of the last
// hour, drawn as inline SVG whose title and description give its numbers.
type chart struct {
	ID, Kind, Group, Title string
	// Start is the start of the first minute.
	Start time.Time
	// Values holds a value per minute, NaN where nothing was measured.
	Values []float64
	// Level draws a line through the values (a sampled level) instead of
	// bars (counts per minute).
	Level bool
	// Desc gives the chart's numbers; Caption, shown under it, the main ones.
	Desc, Caption string
	// Missing says why there is no chart, when there is none.
	Missing string
}

// countChart is a bar per minute of counts (one per minute from start).
func countChart(kind, group, title string, start time.Time, counts []int64) chart {
	c := chart{Kind: kind, Group: group, Title: title, Start: start, Values: make([]float64, len(counts))}
	var total int64
	for i, n := range counts {
		c.Values[i], total = float64(n), total+n
	}
	lo, hi := slices.Min(counts), slices.Max(counts)
	last := counts[len(counts)-1]
	c.Desc = fmt.Sprintf("%s: total %d over the last hour; per minute min %d, max %d, last %d (the current minute, under way).",
		title, total, lo, hi, last)
	c.Caption = fmt.Sprintf("%d in the hour, %d this minute, at most %d", total, last, hi)
	return c
}

// levelChart is a line through the largest sample of each minute from
// start; format writes a value, since says how the samples were taken.
func levelChart(kind, group, title string, start time.Time, samples []sample, format func(float64) string, since string) chart {
	minutes := ops.ThroughputMinutes
	c := chart{Kind: kind, Group: group, Title: title, Start: start, Values: make([]float64, minutes), Level: true}
	for i := range c.Values {
		c.Values[i] = math.NaN()
	}
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, s := range samples {
		// The console's clock may be a little ahead of the database's.
		i := min(int(s.At.Sub(start)/time.Minute), minutes-1)
		if i < 0 {
			continue
		}
		if math.IsNaN(c.Values[i]) || s.V > c.Values[i] {
			c.Values[i] = s.V
		}
		lo, hi = min(lo, s.V), max(hi, s.V)
	}
	if math.IsInf(lo, 1) {
		c.Missing = "not sampled yet"
		return c
	}
	now := format(samples[len(samples)-1].V)
	c.Desc = fmt.Sprintf("%s, sampled %s: min %s, max %s, now %s.", title, since, format(lo), format(hi), now)
	c.Caption = fmt.Sprintf("now %s, at most %s", now, format(hi))
	return c
}

// SVG draws the chart, or says why there is none.
func (c chart) SVG() template.HTML {
	esc := template.HTMLEscapeString
	if c.Missing != "" {
		return template.HTML(fmt.Sprintf(`<span class="muted" data-chart="%s" data-group="%s">%s</span>`, esc(c.Kind), esc(c.Group), esc(c.Missing)))
	}
	hi := 0.0
	for _, v := range c.Values {
		if !math.IsNaN(v) {
			hi = max(hi, v)
		}
	}
	y := func(v float64) float64 { // the baseline is at chartHeight-1
		if hi == 0 {
			return chartHeight - 1
		}
		return chartHeight - 1 - v/hi*(chartHeight-2)
	}
	width := len(c.Values) * barWidth
	var b strings.Builder
	fmt.Fprintf(&b, `<svg class="chart" id="%s" data-chart="%s" data-group="%s" width="%d" height="%d" viewBox="0 0 %[4]d %[5]d" role="img" aria-labelledby="%[1]s-title" aria-describedby="%[1]s-desc">`,
		esc(c.ID), esc(c.Kind), esc(c.Group), width, chartHeight)
	fmt.Fprintf(&b, `<title id="%s-title">%s, %s</title><desc id="%[1]s-desc">%[4]s</desc>`, esc(c.ID), esc(c.Title), esc(c.Group), esc(c.Desc))
	fmt.Fprintf(&b, `<line class="base" x1="0" y1="%d" x2="%d" y2="%[1]d"/>`, chartHeight-1, width)
	if c.Level {
		c.line(&b, y)
	} else {
		c.bars(&b, y)
	}
	b.WriteString(`</svg>`)
	return template.HTML(b.String())
}

// bars draws a bar per minute, each with its minute and count as its title.
func (c chart) bars(b *strings.Builder, y func(float64) float64) {
	for i, v := range c.Values {
		top := y(v)
		fmt.Fprintf(b, `<rect x="%d" y="%.1f" width="%d" height="%.1f" data-v="%s"><title>%s: %[5]s</title></rect>`,
			i*barWidth, top, barWidth-1, chartHeight-1-top, strconv.FormatFloat(v, 'f', -1, 64), c.minute(i))
	}
}

// line draws a line through the measured minutes, broken where a minute
// was not measured, and a dot on the last one.
func (c chart) line(b *strings.Builder, y func(float64) float64) {
	var d strings.Builder
	pen, lastX, lastY := "M", 0.0, 0.0
	for i, v := range c.Values {
		if math.IsNaN(v) {
			pen = "M"
			continue
		}
		lastX, lastY = float64(i*barWidth)+barWidth/2.0, y(v)
		fmt.Fprintf(&d, "%s%.1f %.1f ", pen, lastX, lastY)
		pen = "L"
	}
	fmt.Fprintf(b, `<path d="%s"/><circle cx="%.1f" cy="%.1f" r="2"/>`, strings.TrimSpace(d.String()), lastX, lastY)
}

// minute names minute i, as the console writes times.
func (c chart) minute(i int) string {
	return c.Start.Add(time.Duration(i) * time.Minute).UTC().Format("15:04Z")
}

// groupCharts are the two charts of one relay or consumer group.
type groupCharts struct {
	Group       string
	Rate, Level chart
}

// chartsData is the overview's charts.
type chartsData struct {
	Start          time.Time // the first minute's
	History        history
	Partial        bool // the console has sampled for less than an hour
	Relay, Consume []groupCharts
}

// charts reads the last hour's throughput and the console's samples into
// the overview's charts.
func (c *Console) charts(ctx context.Context) (chartsData, error) {
	tp, err := c.ops.Throughput(ctx)
	if err != nil {
		return chartsData{}, err
	}
	h := c.samples.since(tp.Start)
	d := chartsData{Start: tp.Start, History: h, Partial: h.Started.After(tp.Start)}
	since := "every " + h.Every.String() + " over the last hour"
	if d.Partial {
		since = "every " + h.Every.String() + " since the console started at " + h.Started.UTC().Format("15:04:05Z")
	}
	seconds := func(v float64) string {
		return time.Duration(v * float64(time.Second)).Round(time.Millisecond).String()
	}
	messages := func(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }
	for i, g := range sortedKeys(tp.Forwarded, h.Oldest) {
		gc := groupCharts{Group: g,
			Rate:  countChart("forwarded", g, "Events forwarded per minute", tp.Start, orZeros(tp.Forwarded[g])),
			Level: levelChart("oldest", g, "Oldest pending age", tp.Start, h.Oldest[g], seconds, since)}
		gc.Rate.ID, gc.Level.ID = fmt.Sprintf("chart-forwarded-%d", i), fmt.Sprintf("chart-oldest-%d", i)
		d.Relay = append(d.Relay, gc)
	}
	for i, g := range sortedKeys(tp.Processed, h.Backlog) {
		gc := groupCharts{Group: g,
			Rate:  countChart("processed", g, "Events processed per minute", tp.Start, orZeros(tp.Processed[g])),
			Level: levelChart("lag", g, "Lag, messages not consumed yet", tp.Start, h.Backlog[g], messages, since)}
		switch {
		case !h.Metrics:
			gc.Level.Missing = "not measured: the console has no metrics of the consumers (console.Options.Metrics)"
		case gc.Level.Missing != "":
			gc.Level.Missing = "not measured: no handler of this group reports its backlog in this process"
		}
		gc.Rate.ID, gc.Level.ID = fmt.Sprintf("chart-processed-%d", i), fmt.Sprintf("chart-lag-%d", i)
		d.Consume = append(d.Consume, gc)
	}
	return d, nil
}

// sortedKeys returns the keys of a and b, sorted, once each.
func sortedKeys[A, B any](a map[string]A, b map[string]B) []string {
	keys := slices.Collect(maps.Keys(a))
	for k := range b {
		if _, ok := a[k]; !ok {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	return keys
}

// orZeros returns counts, or a zero per minute when there are none (a
// group sampled but without rows in the hour).
func orZeros(counts []int64) []int64 {
	if counts == nil {
		return make([]int64, ops.ThroughputMinutes)
	}
	return counts
}
